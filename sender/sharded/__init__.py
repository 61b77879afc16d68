"""Sharded (FSDP2) trainers: ``ShardedSync`` and the ranks' lockstep, every rank comparing its
own shards (``shards.py``), the encoded parts moved to the leader (``shard_parts.py``,
``shard_build.py``), DTensor gathers where a tensor must travel whole (``gathers.py``).

May import every other room of the sender, its floor and ``protocol``.
"""
