"""The redis-server the tests start (the helper lives in kvstrata.storage.redis_server, which the
storage bench uses too)."""

from kvstrata.local_ports import free_port
from kvstrata.storage.redis_server import RedisServer, find_redis_server, ping

__all__ = ["RedisServer", "find_redis_server", "free_port", "ping"]
