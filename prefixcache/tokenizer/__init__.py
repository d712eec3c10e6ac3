"""Text <-> token ids, outside the model: loading a tokenizer from GGUF metadata or a Hugging
Face directory (tokenizer.py; gguf.py rebuilds transformers' pipeline from a GGUF's metadata),
chat templates (chat.py) and the segments mode's document spans (segments.py). No torch: the
server, the cluster ingress, bench and analyze tokenize without loading a model.
"""
