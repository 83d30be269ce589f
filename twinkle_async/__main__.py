"""`python -m twinkle_async` is the `twinkle-async` command."""

from twinkle_async.cli import main

main()
