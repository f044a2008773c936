"""Tests of gateway/routing: pool routers, prefix hashing and indexes, KV events, tokens, rollouts."""
