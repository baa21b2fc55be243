"""The offline caption-similarity job: caption embeddings keyed by ``__key__``,
class-template graphs and caption-neighbour graphs."""
