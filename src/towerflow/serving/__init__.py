"""The serving side of a training job: the rows it publishes while it trains, applied and looked up by id.

`EmbeddingStore(PUBLISH_DIR)` reads what `towerflow launch --publish-every S` makes the ps tasks write
(docs/serving.md);
`RedisRows(redis://HOST:PORT/DB)` looks up what they write to Redis.
"""

from towerflow.serving.embedding_store import EmbeddingStore, PublicationGapError
from towerflow.serving.redis_rows import RedisRows

__all__ = ["EmbeddingStore", "PublicationGapError", "RedisRows"]
