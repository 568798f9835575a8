"""The parts of `shardkit.io.reader.CheckpointReader`, each over one `shards.ShardSet`
(docs/ARCHITECTURE.md lists them)."""
