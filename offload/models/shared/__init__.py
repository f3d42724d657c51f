"""What the architecture files share: the block and model base (``base``), the GGUF config
readers (``config``) and the leaf builders (``parts``)."""
