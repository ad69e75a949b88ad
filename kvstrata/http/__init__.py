"""The HTTP rules every kvstrata server shares (`kvstrata serve` of any role, the router, the P/D
routes): one place for each, installed by `rules.add_http_rules` and `rules.server_options`.

auth          API-key middleware (`Authorization: Bearer KEY`), the key resolved at start
body          JSON request bodies: content type, size cap, read deadline, one well-formed object
config        HttpConfig: the listener's options (address, key, limits, stop), serve's and router's
errors        ApiError (vLLM's error JSON) and the apps' exception handlers
latency       the latency histogram buckets of every server's /metrics
paths         the paths one server reads of another (/v1/pd/info, /v1/kv/events/info)
rules         installs the middlewares in order; uvicorn's options for slow clients
slow_clients  a connection that does not finish its request headers in time is closed (408)
sse           server-sent event frames
"""
