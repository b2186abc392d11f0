"""pagedserve_client: the Python SDK for pagedserve's public gRPC API (no torch needed).

    from pagedserve_client import Client
    with Client("127.0.0.1:50051") as c:
        print(c.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=20).text)
"""

from pagedserve_client.client import AsyncClient, Client, build_request
from pagedserve_client.embeddings import EmbeddingResult
from pagedserve_client.text_types import ModelInfo, TokenizeResult
from pagedserve_client.types import (
    Choice,
    GenerationResult,
    StreamDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = ["AsyncClient", "Choice", "Client", "EmbeddingResult", "GenerationResult", "ModelInfo",
           "StreamDelta", "TokenLogprob", "TokenizeResult", "TopLogprob", "Usage",
           "build_request"]
