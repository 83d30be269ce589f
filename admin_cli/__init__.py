"""`twinkle-admin`: the operator's command line for the gateway's admin API (`/admin/v1/...`).

It speaks HTTP only (`admin_cli.client`), so it runs on any machine that reaches the gateway and
never imports the gateway's or the workers' code.
"""
