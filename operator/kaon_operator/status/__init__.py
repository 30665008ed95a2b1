"""An InferenceService's status: cluster objects read into summaries (summaries), the conditions
and Events built from them (conditions: pure), and their writing once per burst of events
(status_sync, status_queue)."""
