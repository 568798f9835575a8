"""The parts of `shardkit.io.reader.CheckpointReader`, each over one `shards.ShardSet`.

Its modules, each importing only those before it: `shards` (the index and the shard sources of
one opened checkpoint, the read pool, reads in flight), `jobs` (byte reads cut at each source's
granularity, run on the pool), `whole` (whole tensors, one or in bulk), `boxes` (`get_slice`
and the boxes restores read), `verify` (`VerifyReport`, entries against the index and their
checksums).
"""
