"""The DeepSpeed engine and what builds and runs a step on it: the train module, the model's construction, the
layout, process groups, DeepSpeed's ops and wrappers (Ulysses, the tiled MLP, AutoTP's input check), compilation."""
