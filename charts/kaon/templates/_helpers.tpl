{{/*
Base name of every object. Truncated to 40 characters so that "<fullname>-operator-metrics"
still fits a 63-character DNS label.
*/}}
{{- define "kaon.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains "kaon" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kaon" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
Labels of one component ("operator" or "router"). app.kubernetes.io/name is always "kaon":
the operator finds router pods by app.kubernetes.io/name=kaon + component=router (it scrapes
their held requests to scale from zero), so it is not overridable.
*/}}
{{- define "kaon.selectorLabels" -}}
app.kubernetes.io/name: kaon
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kaon.labels" -}}
{{ include "kaon.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "kaon.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Peering is on with more than one operator replica, or when asked for. */}}
{{- define "kaon.peering" -}}
{{- if or .Values.operator.peering.enabled (gt (int .Values.operator.replicas) 1) -}}true{{- end -}}
{{- end -}}

{{- define "kaon.peeringName" -}}
{{- .Values.operator.peering.name | default (printf "%s-operator" (include "kaon.fullname" .)) -}}
{{- end -}}
