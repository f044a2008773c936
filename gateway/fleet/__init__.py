"""The engines the gateway sends to: pools and their replicas (membership, health, circuit
breakers, load), the launcher and one adapter per engine kind, load scraping, discovery and
Kubernetes manifests.

May import: the base modules only.
"""
