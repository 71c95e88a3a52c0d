"""The daemon's gRPC edge: the servicer, interceptors, the peer-credential gate, TLS, listen
addresses, and domain errors -> status codes.
"""
