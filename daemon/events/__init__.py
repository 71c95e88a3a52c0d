"""KV events (issue 22): the committed blocks a daemon gains and loses, published over ZMQ in
vLLM's wire format for KV-aware routers (llm-d's KV-cache indexer, Dynamo's KV router).

`sink` is what the daemon's event sources call (`KVEventSink`, `StoredBlock`, `NullSink`);
`wire` the msgpack records and their encoding; `publisher` the sink that queues them on the
event loop, `sender` the thread that owns the sockets (PUB, replay, snapshot) and `replay` the
buffer and the bounded answers to replay and snapshot requests. No zmq below
this room: the core and the service see only the sink.
"""
