"""llama.cpp's library through llama-cpp-python, as the tokenizer and the llama.cpp runtimes
load it."""
