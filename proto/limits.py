"""Limits of the wire that the daemon and its clients share.

`MAX_MESSAGE_BYTES` is the largest gRPC message the daemon and the runner accept (a request) or
may send (an answer, if its operator allows answers that large): both servers
(process/grpc_server.py) and both bundled channels (client/pool/channel.py) set it for sending
and for receiving, through `MESSAGE_SIZE_OPTIONS`.

`DEFAULT_ANSWER_BYTES` is the daemon's default `max_answer_bytes`: the daemon refuses, before
building it, any answer that would be larger. It fits gRPC's default receive limit of 4 MiB
(`GRPC_DEFAULT_RECEIVE_BYTES`), which every stock client has in every language, so a client
that never raised its limit never has a call applied at the daemon and its answer refused by
its own size check. An operator who raises `max_answer_bytes` (up to MAX_MESSAGE_BYTES) must
tell schedulers with their own stubs to raise `grpc.max_receive_message_length` to it.
"""

# 8 MiB: the token ids of a prompt of over a million tokens (varints of 3 to 5 bytes), or the
# slots of a million-token Allocate on a pool of up to 2^35 slots.
MAX_MESSAGE_BYTES = 8 * 2**20

# gRPC's default grpc.max_receive_message_length, in every language's stock channel.
GRPC_DEFAULT_RECEIVE_BYTES = 4 * 2**20
# What an answer's budget leaves below GRPC_DEFAULT_RECEIVE_BYTES: the few fields the budget
# does not charge (a response's free_blocks, 11 bytes at most), with room to spare.
ANSWER_MARGIN_BYTES = 4096
DEFAULT_ANSWER_BYTES = GRPC_DEFAULT_RECEIVE_BYTES - ANSWER_MARGIN_BYTES

# gRPC channel and server options that apply MAX_MESSAGE_BYTES both ways.
MESSAGE_SIZE_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
