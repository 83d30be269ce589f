"""The Twinkle processor service: the remote `Dataset` and `DataLoader` objects of twinkle's
client (`twinkle_client.dataset.Dataset`, `twinkle_client.dataloader.DataLoader`), run with
twinkle-kit's own classes behind an explicit allow-list.

It runs under twinkle-kit's interpreter, with the repository root on `sys.path`:
`python -m workers.processor --host H --port P --ready-file F --secret-file S --data-root DIR
--model NAME=PATH ...`. It imports only the standard library, aiohttp, numpy, torch and twinkle,
and nothing of this repository outside `workers.processor`. Our gateway forwards the
client's bodies to it (`twinkle_async/gateway/processor_routes.py`).

- `checks`: the fields, files, slices, models and init_args a caller may send;
- `registry`: the objects of each (tenant, session), their budget and idle expiry;
- `objects`: what may be created and called, and the twinkle work each call runs;
- `service`: the HTTP routes, the secret, the error answers, the thread pool.
"""
