"""The serving side of a training job: the rows it publishes while it trains, applied and looked up by id.

`EmbeddingStore(PUBLISH_DIR)` reads what `towerflow launch --publish-every S` makes the ps tasks write
(docs/serving.md).
"""

from towerflow.serving.embedding_store import EmbeddingStore, PublicationGapError

__all__ = ["EmbeddingStore", "PublicationGapError"]
