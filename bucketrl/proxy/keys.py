"""Every Redis key the proxy uses, in one place. All keys of a run share the ``brl:{run}:`` prefix.

Redis holds coordination state only (versions index, leases, queue pointers, cursors, counters);
the bucket holds the bytes and the manifests a rebuild starts from.
"""


def run_key(run: str, suffix: str) -> str:
    return f"brl:{run}:{suffix}"


RUNS_SET = "brl:runs"  # set of run ids
REBUILDING = "brl:rebuilding"  # set while a proxy restores runs from the bucket (rebuild.py)
BUCKET_IDENTITY = "brl:bucket"  # JSON {bucket_id, created_at}: the bucket this Redis belongs to (identity.py)

# Per run (suffixes passed to run_key):
SPEC = "spec"  # JSON RunSpec
STATE = "state"  # hash: latest_version, trainer_epoch, trainer_step, created_at, updated_at
VERSIONS = "versions"  # zset version -> published_at ; hash "version:{N}" -> sha256, bytes, published_at
VERSION_CHANNEL = "versions:channel"  # pub/sub channel announcing new versions
PIPELINE_CHANNEL = "pipeline:channel"  # pub/sub channel announcing that admission control may grant more
CJOBS_CHANNEL = "cjobs:channel"  # pub/sub: a completion job was queued (generators long-polling wake)
CJOBS_DONE_CHANNEL = "cjobsdone:channel"  # pub/sub: a completion job was answered (askers long-polling wake)
DRAIN_CHANNEL = "drains:channel"  # pub/sub: a worker was told to drain (its drain long-poll wakes)
CJOB = "cjob:"  # hash "cjob:{request_id}": state, request, version, seq, lease_id, worker, result (ttl_s)
CJOBS_QUEUED = "cjobs:queued"  # zset request_id -> seq (re-offered ones: seq - 1e15, first in line)
CJOBS_LEASED = "cjobs:leased"  # zset request_id -> lease expiry
CJOBS_SEQ = "cjobs:seq"  # int: the job sequence and lease ids
LEASES = "leases"  # zset lease_id -> expires_at ; hash "lease:{id}" -> version, worker_id
CHECKPOINTS = "checkpoints"  # zset step -> created_at
PROMPT_CURSOR = "prompts:cursor"  # int: next never-issued global prompt position
PROMPT_INFLIGHT = "prompts:inflight"  # zset prompt_id -> lease expiry
PROMPT_REISSUE = "prompts:reissue"  # list of prompt ids to issue again (expired or released)
PROMPT_DONE = "prompts:done"  # set of completed prompt ids (current pass window)
QUEUE_STREAM = "queue:stream"  # Redis stream of rollout pointers (consumer group "trainer")
IDEMPOTENCY = "idem"  # hash Idempotency-Key -> batch_id
COUNTERS = "counters"  # hash of monotonically increasing counters
WORKERS = "workers"  # hash worker_id -> JSON {role, loaded_versions, last_seen, metrics}
METRICS_STREAM = "metrics:stream"  # capped stream of pushed metrics for the dashboard

# Added by the proxy core (P2):
VERSION_INFO = "version:{n}"  # hash: sha256, bytes, published_at, epoch, dtype, state (live | deleting | gone)
VERSION_LEASES = "vleases:{n}"  # zset lease_id -> expires_at, the live leases of one version (GC checks it)
LEASE_INFO = "lease:{id}"  # hash: version, worker_id, expires_at
GC_DELETING = "gc:deleting"  # set of versions marked 'deleting' whose bucket files may still exist
GC_HOLD = "gc:hold"  # present (with a TTL) after a rebuild: no GC until generators re-leased
CHECKPOINT_INFO = "ckpt:{step}"  # hash: sha256, bytes, created_at, epoch
WRITE_LOCK = "lock:{name}"  # owner token of an in-flight bundle write (adapter version or checkpoint step)
WORKER_METRICS = "wmetrics:{worker}"  # hash metric name -> latest value of one worker
COST_USAGE = "cost:usage"  # hash {role}|{class}|{field} -> float, trained_tokens (state/cost.py; in the snapshot)
TOKENS_RECENT = "tokrecent"  # hash: 10 s slot (Redis TIME // 10) -> generated tokens accepted in it (last ~2 min)
POOL = "pool"  # hash: paused (1/0), credit (fair-share tokens credited on activation), last_granted (Redis TIME)
POOL_REQUEST = "brl:poolreq:{worker}:{request_id}"  # the run a pool lease's first attempt picked (replays)
WORKER_DRAIN = "drain:{worker}"  # deadline (Redis TIME) of a worker told to drain; expires with the notice
