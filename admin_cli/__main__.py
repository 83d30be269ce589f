"""`python -m admin_cli` is the `twinkle-admin` command."""

from admin_cli.app import main

main()
