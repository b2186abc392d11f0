{{/* Chart name, truncated to a DNS label. */}}
{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name; leaves room for the "-engine" / "-router" suffixes. */}}
{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pagedserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels; call with (dict "ctx" $ "component" "router"). */}}
{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ include "pagedserve.chart" .ctx }}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: pagedserve
{{- end }}

{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pagedserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagedserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference; call with (dict "ctx" $ "image" .Values.image.router). */}}
{{- define "pagedserve.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* The engines' headless Service name (the router resolves it: dns:///NAME:PORT). */}}
{{- define "pagedserve.engineService" -}}
{{- printf "%s-engine" (include "pagedserve.fullname" .) }}
{{- end }}

{{/* Every worker rank address inside an engine pod, rank 0 first. */}}
{{- define "pagedserve.workerAddresses" -}}
{{- $addrs := list }}
{{- range $r := until (int .Values.engine.tensorParallelSize) }}
{{- $addrs = append $addrs (printf "127.0.0.1:%d" (add (int $.Values.engine.worker.port) $r)) }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{/* Model volume mount (router and worker) when a PVC holds the model. */}}
{{- define "pagedserve.modelVolumeMount" -}}
{{- if .Values.model.persistence.enabled }}
- name: models
  mountPath: {{ .Values.model.persistence.mountPath }}
  readOnly: true
  {{- with .Values.model.persistence.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{- define "pagedserve.modelVolume" -}}
{{- if .Values.model.persistence.enabled }}
- name: models
  persistentVolumeClaim:
    claimName: {{ required "model.persistence.existingClaim is required when model.persistence.enabled" .Values.model.persistence.existingClaim }}
    readOnly: true
{{- end }}
{{- end }}

{{/* A pod's terminationGracePeriodSeconds, checked to leave the services their drain time
(shutdownTimeout) before SIGKILL; call with (dict "ctx" $ "component" "router" "seconds" N). */}}
{{- define "pagedserve.gracePeriod" -}}
{{- if le (float64 .seconds) (float64 .ctx.Values.shutdownTimeout) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must be larger than shutdownTimeout (%v): Kubernetes would kill the pod while it drains" .component .seconds .ctx.Values.shutdownTimeout) }}
{{- end }}
{{- .seconds }}
{{- end }}

{{/* "true" when an autoscaler (the HPA, or KEDA's) owns the engine replica count. */}}
{{- define "pagedserve.engineAutoscaled" -}}
{{- if or .Values.autoscaling.enabled .Values.autoscaling.keda.enabled }}true{{ end }}
{{- end }}

{{/* The prefix of the scheduler's /metrics names (engine.scheduler.metricsNames: both serves
both; the pagedserve: ones are used). */}}
{{- define "pagedserve.metricsPrefix" -}}
{{- ternary "vllm" "pagedserve" (eq .Values.engine.scheduler.metricsNames "vllm") }}
{{- end }}

{{/* The scheduler's --kv-events-config: engine.scheduler.kvEventsConfig when set; else, under
router.routingPolicy cache_aware, events on the gRPC stream only (the routers subscribe to it);
else "" (events off). */}}
{{- define "pagedserve.kvEventsConfig" -}}
{{- if .Values.engine.scheduler.kvEventsConfig -}}
{{- .Values.engine.scheduler.kvEventsConfig -}}
{{- else if eq .Values.router.routingPolicy "cache_aware" -}}
{"enable_kv_cache_events": true, "publisher": "null"}
{{- end -}}
{{- end }}
