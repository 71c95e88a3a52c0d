"""Limits of the wire that the daemon and its clients share.

`MAX_MESSAGE_BYTES` is the largest gRPC message either side sends or accepts: the daemon's
server and the bundled client's channel both set it for sending and for receiving, and the
daemon refuses, before building it, any answer that would be larger (`max_answer_bytes`, at most
this). So a call is never applied at the daemon and then lost to the client's size check.
Schedulers with their own stubs should set the same limits on their channels.
"""

# 8 MiB: the token ids of a prompt of over a million tokens (varints of 3 to 5 bytes), or the
# slots of a million-token Allocate on a pool of up to 2^35 slots.
MAX_MESSAGE_BYTES = 8 * 2**20

# gRPC channel and server options that apply MAX_MESSAGE_BYTES both ways.
MESSAGE_SIZE_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
