"""Building blocks every model family shares: weights, norms, rotary embeddings, the attention
glue over the paged cache, gated MLPs, the mixture-of-experts block and the output head."""
