"""What the prompt is: the endpoint table (which URL paths serve which endpoint, its tasks and where
its prompts are), canonicalization, token counting, the chained prefix block hashes, and the
prompt window that drops the oldest turns.

May import: the base modules.
"""
