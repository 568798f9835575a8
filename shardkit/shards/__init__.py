"""One reader and one writer per shard kind (raw, skz) over a byte source."""
