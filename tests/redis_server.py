"""The redis-server the tests start (the helper lives in kvstrata.storage.redis_server, which the
storage bench uses too)."""

from kvstrata.storage.redis_server import RedisServer, find_redis_server, free_port, ping

__all__ = ["RedisServer", "find_redis_server", "free_port", "ping"]
