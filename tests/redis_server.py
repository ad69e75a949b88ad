"""The redis-server the tests start (the helper lives in kvstrata.bench.local_redis, which the
storage bench uses too)."""

from kvstrata.bench.local_redis import RedisServer, find_redis_server, ping
from kvstrata.local_ports import free_port

__all__ = ["RedisServer", "find_redis_server", "free_port", "ping"]
