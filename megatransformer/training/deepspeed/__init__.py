"""Everything that reads DeepSpeed's private state: its partitions' map, its bf16 step, the attributes behind them."""
