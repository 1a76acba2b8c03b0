"""What serves /generate and takes new weights: SGLang engines behind the router on GPU, the CPU engine server (and a
replay engine) on CPU, all speaking SGLang's native HTTP API; the client both the rollout and weight sync use, and
the wire formats of weight updates that both ends speak."""
