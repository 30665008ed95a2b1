"""kaon operator: InferenceService CRD reconciler (built in its own issue)."""
