"""Where a request goes: the rollout router (model -> pool), each pool's router (features,
candidates, ranking by the policy plugin, learning), prefix hashing and indexes, KV events,
precise prefix mode, canonicalization and token counting.

May import: fleet and the base modules.
"""
