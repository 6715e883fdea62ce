"""Store and trace tools: convert, the store writer, synthetic stores, tiny models, trace
recording, text warm-up."""
