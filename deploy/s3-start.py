"""Start SeaweedFS with S3 on port 8333 (data under /data) and create the `twinkle` bucket once
it answers; then wait on it (its exit is the container's)."""

import subprocess
import sys
import time
import urllib.error
import urllib.request

weed = subprocess.Popen(
    [
        *("weed", "server", "-dir=/data", "-ip=127.0.0.1", "-ip.bind=0.0.0.0"),
        *("-s3", "-s3.port=8333", "-s3.port.iceberg=0", "-s3.port.lance=0"),
        *("-master.telemetry=false", "-volume.max=50"),
    ]
)
while weed.poll() is None:
    try:
        request = urllib.request.Request("http://127.0.0.1:8333/twinkle", method="PUT")
        urllib.request.urlopen(request, timeout=5).close()
        break
    except urllib.error.HTTPError as err:
        if err.code == 409:  # the bucket is there already: a restart
            break
    except OSError:
        pass
    time.sleep(0.5)
print("s3: bucket twinkle ready on :8333", flush=True)
sys.exit(weed.wait())
