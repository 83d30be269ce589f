"""Wire types of Twinkle Async: Tinker JSON and protobuf bodies, bus jobs and outcomes,
subjects, errors and limits.

Pure data and pure encode/decode: no sockets, no event loop, no torch. Both the gateway
(`twinkle_async`) and the workers (`workers`) import this package, so every message is
declared once here.
"""
