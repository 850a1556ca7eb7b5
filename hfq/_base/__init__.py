"""What NVFP4, QuEST and QFT share: the config base and the model surgery."""
