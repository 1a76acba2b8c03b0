"""Rollout: inference engines behind SGLang's HTTP API, the client that talks to them, and sampling maths."""
