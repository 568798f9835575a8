"""The callback contract: ShardableTensor, flattening, validation, policies."""
