"""Model graphs: the layer-op registry (layers), `@mdsl.model` tracing and the graphs' text form (model),
the built-in architectures' step functions (architectures), Hugging Face configs and checkpoints
(model_config, checkpoint, safetensors), the fused linear ops' element-wise epilogues (epilogues) and the
numpy reference forward (reference)."""
