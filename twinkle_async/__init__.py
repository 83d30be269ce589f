"""The gateway side of Twinkle Async: the Tinker HTTP API, the bus wrapper, futures, the
registry of sessions, runs and checkpoints, and the `twinkle-async` command line with the `up`
supervisor. Never imports torch or `workers`: workers are separate processes.
"""
