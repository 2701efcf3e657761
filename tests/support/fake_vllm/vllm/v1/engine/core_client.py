class EngineCoreClient:
    pass


class InprocClient(EngineCoreClient):
    """The engine core in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""


class SyncMPClient(EngineCoreClient):
    """The engine core in a process of its own: ``collective_rpc`` arguments cross as msgpack."""
