"""The offline caption-similarity job (issue #5): caption embeddings keyed by ``__key__``,
class-template graphs and caption-neighbour graphs."""
