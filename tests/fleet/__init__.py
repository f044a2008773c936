"""Tests of gateway/fleet: launcher, load scraping, managed fleets, discovery, engine adapters."""
