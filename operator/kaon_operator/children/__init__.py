"""An InferenceService's children: the pure renderers of its Deployment (or LeaderWorkerSet),
Service, PDB and NetworkPolicy (resources, pod_template, leaderworkerset), the pure decisions
about them (changes, ownership), and drift (a child deleted or edited by someone else)."""
