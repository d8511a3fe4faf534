"""llama.cpp in one board process: the engine, its bindings and CPU kernel class, the model file,
sampling, chat templates and the memory and compute measures a board sizes itself by. Called by the
serving strategies and the board runtime."""
