"""What a training process stands on before any engine: its process groups and the DeepSpeed ops they build, its
layout (batch arithmetic, the ZeRO stage the engine runs) and its host-memory policy."""
