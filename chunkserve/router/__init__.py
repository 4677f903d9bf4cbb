"""`chunkserve router`: one endpoint in front of N chunkserve replicas that routes each request
to the replica predicted to answer it first, knowing what every replica has cached.

No torch (it imports the scheduler's tokenizer, validation and block hash only). Modules:

  cli.py        the command's flags
  app.py        the process: gRPC, HTTP, admin and metrics servers, start and stop
  replicas.py   replica addresses (--replica, DNS), health checks, KV event index, load polls
  core.py       tokenize, hash, score, place; what is in flight where
  scoring.py    the decision itself, pure (cache_aware, round_robin, least_loaded)
  grpc_front.py chunkserve.v1.Generation proxied (router request ids, retry before the first
                token), the chunkserve.v1.Router operator service
  legs.py       the leg to a replica: one Multiplex stream per replica carrying every request
                (--replica-transport mux), or a Generate call per request (call, and the fallback)
  wire.py       a streamed GenerateResponse's request id replaced in its bytes (no decode/encode)
  http_front.py the OpenAI HTTP API proxied
  metrics.py    Prometheus metrics of decisions and replicas

docs/deploy.md says how to run it, and how other gateways route to chunkserve instead.
"""
