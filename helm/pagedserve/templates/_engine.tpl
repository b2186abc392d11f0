{{/*
The engine's containers, shared by the single-pod StatefulSet (engine-statefulset.yaml) and the
multi-host LeaderWorkerSet (engine-leaderworkerset.yaml). Argument: (dict "ctx" $ "multiHost"
BOOL); with multiHost the worker is one host's share (one pipeline stage) of a group spanning
engine.pipelineParallelSize pods, and the scheduler lists every pod's ranks.
*/}}

{{/* The LeaderWorkerSet's name, also its headless Service's (LWS makes it): pod DNS names are
POD.NAME.NAMESPACE.svc.DOMAIN; leader pods NAME-GROUP, worker pods NAME-GROUP-INDEX. */}}
{{- define "pagedserve.lwsName" -}}
{{- printf "%s-lws" (include "pagedserve.fullname" .) }}
{{- end }}

{{/* GROUP_INDEX: this pod's group (replica) in the LeaderWorkerSet, from LWS's label. */}}
{{- define "pagedserve.groupIndexEnv" -}}
- name: GROUP_INDEX
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/group-index']
{{- end }}

{{/* DNS name of pod WORKER_INDEX (0: the leader) of this pod's group; needs GROUP_INDEX. */}}
{{- define "pagedserve.groupPodHost" -}}
{{- $lws := include "pagedserve.lwsName" .ctx }}
{{- $pod := printf "%s-$(GROUP_INDEX)" $lws }}
{{- if gt (int .index) 0 }}{{ $pod = printf "%s-%d" $pod (int .index) }}{{ end }}
{{- printf "%s.%s.%s.svc.%s" $pod $lws .ctx.Release.Namespace .ctx.Values.clusterDomain }}
{{- end }}

{{/* Every rank of a multi-host group, rank order: the leader's on 127.0.0.1, then each worker
pod's, each pod's ranks on worker.port + i. */}}
{{- define "pagedserve.groupWorkerAddresses" -}}
{{- $addrs := list }}
{{- $port := int .Values.engine.worker.port }}
{{- range $node := until (int .Values.engine.pipelineParallelSize) }}
{{- range $i := until (int $.Values.engine.tensorParallelSize) }}
{{- if eq $node 0 }}
{{- $addrs = append $addrs (printf "127.0.0.1:%d" (add $port $i)) }}
{{- else }}
{{- $addrs = append $addrs (printf "%s:%d" (include "pagedserve.groupPodHost" (dict "ctx" $ "index" $node)) (add $port $i)) }}
{{- end }}
{{- end }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{/* The worker flags of one host of a multi-host group (README.md, Several hosts). */}}
{{- define "pagedserve.multiHostWorkerEnv" -}}
{{- $e := .ctx.Values.engine }}
{{- include "pagedserve.groupIndexEnv" . }}
- name: PAGEDSERVE_PIPELINE_PARALLEL_SIZE
  value: {{ $e.pipelineParallelSize | quote }}
- name: PAGEDSERVE_NNODES
  value: {{ $e.pipelineParallelSize | quote }}
- name: PAGEDSERVE_NODE_RANK
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']
- name: PAGEDSERVE_DIST_INIT_ADDR
  value: {{ printf "%s:%d" (include "pagedserve.groupPodHost" (dict "ctx" .ctx "index" 0)) (int $e.multiHost.distInitPort) | quote }}
- name: PAGEDSERVE_DISTRIBUTED_TIMEOUT
  value: {{ $e.multiHost.distributedTimeout | quote }}
{{- with $e.pipelineLayerPartition }}
- name: PAGEDSERVE_PIPELINE_LAYER_PARTITION
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{- define "pagedserve.schedulerContainer" -}}
- name: scheduler
  image: {{ include "pagedserve.image" (dict "ctx" $.ctx "image" $.ctx.Values.image.scheduler) }}
  imagePullPolicy: {{ $.ctx.Values.image.pullPolicy }}
  command: ["pagedserve", "scheduler"]
  env:
    {{- if $.multiHost }}
    {{- include "pagedserve.groupIndexEnv" . | nindent 4 }}
    {{- end }}
    - name: PAGEDSERVE_HOST
      value: "0.0.0.0"
    - name: PAGEDSERVE_PORT
      value: {{ $.ctx.Values.engine.scheduler.port | quote }}
    - name: PAGEDSERVE_METRICS_PORT
      value: {{ $.ctx.Values.engine.scheduler.metricsPort | quote }}
    - name: PAGEDSERVE_WORKERS
      value: {{ include (ternary "pagedserve.groupWorkerAddresses" "pagedserve.workerAddresses" (eq $.multiHost true)) $.ctx | quote }}
    - name: PAGEDSERVE_BLOCK_SIZE
      value: {{ $.ctx.Values.engine.scheduler.blockSize | quote }}
    - name: PAGEDSERVE_MAX_NUM_SEQS
      value: {{ $.ctx.Values.engine.scheduler.maxNumSeqs | quote }}
    - name: PAGEDSERVE_MAX_NUM_BATCHED_TOKENS
      value: {{ $.ctx.Values.engine.scheduler.maxNumBatchedTokens | quote }}
    - name: PAGEDSERVE_ENABLE_PREFIX_CACHING
      value: {{ $.ctx.Values.engine.scheduler.enablePrefixCaching | quote }}
    - name: PAGEDSERVE_SCHEDULING_POLICY
      value: {{ $.ctx.Values.engine.scheduler.schedulingPolicy | quote }}
    - name: PAGEDSERVE_MAX_NUM_WAITING_REQUESTS
      value: {{ $.ctx.Values.engine.scheduler.maxNumWaitingRequests | quote }}
    - name: PAGEDSERVE_METRICS_NAMES
      value: {{ $.ctx.Values.engine.scheduler.metricsNames | quote }}
    {{- with (include "pagedserve.kvEventsConfig" $.ctx) }}
    - name: PAGEDSERVE_KV_EVENTS_CONFIG
      value: {{ . | quote }}
    {{- end }}
    {{- if $.ctx.Values.kvOffload.enabled }}
    - name: PAGEDSERVE_KV_OFFLOAD_SIZE
      value: {{ $.ctx.Values.kvOffload.size | quote }}
    {{- end }}
    {{- with $.ctx.Values.tracing.otlpTracesEndpoint }}
    - name: PAGEDSERVE_OTLP_TRACES_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    - name: PAGEDSERVE_LOG_LEVEL
      value: {{ $.ctx.Values.logLevel | quote }}
    - name: PAGEDSERVE_SHUTDOWN_TIMEOUT
      value: {{ $.ctx.Values.shutdownTimeout | quote }}
    {{- with $.ctx.Values.engine.scheduler.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: grpc
      containerPort: {{ $.ctx.Values.engine.scheduler.port }}
      protocol: TCP
    - name: metrics
      containerPort: {{ $.ctx.Values.engine.scheduler.metricsPort }}
      protocol: TCP
  # Readiness = the ability to serve: gRPC health "" is SERVING only while the scheduler
  # has a complete worker group. Startup and liveness check the health name "liveness"
  # (SERVING while the process runs), so a scheduler waiting for its workers (model
  # loading, a worker restarting) is not restarted itself.
  startupProbe:
    grpc:
      port: {{ $.ctx.Values.engine.scheduler.port }}
      service: liveness
    periodSeconds: {{ $.ctx.Values.engine.probes.startup.periodSeconds }}
    failureThreshold: {{ $.ctx.Values.engine.probes.startup.failureThreshold }}
  readinessProbe:
    grpc:
      port: {{ $.ctx.Values.engine.scheduler.port }}
    periodSeconds: {{ $.ctx.Values.engine.probes.readiness.periodSeconds }}
    failureThreshold: {{ $.ctx.Values.engine.probes.readiness.failureThreshold }}
  livenessProbe:
    grpc:
      port: {{ $.ctx.Values.engine.scheduler.port }}
      service: liveness
    periodSeconds: {{ $.ctx.Values.engine.probes.liveness.periodSeconds }}
    failureThreshold: {{ $.ctx.Values.engine.probes.liveness.failureThreshold }}
  resources:
    {{- toYaml $.ctx.Values.engine.scheduler.resources | nindent 4 }}
  securityContext:
    {{- toYaml $.ctx.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    {{- include "pagedserve.kvTierVolumeMount" $.ctx | nindent 4 }}
{{- end }}

{{- define "pagedserve.workerContainer" -}}
{{- $tp := int $.ctx.Values.engine.tensorParallelSize }}
- name: worker
  image: {{ include "pagedserve.image" (dict "ctx" $.ctx "image" $.ctx.Values.image.worker) }}
  imagePullPolicy: {{ $.ctx.Values.image.pullPolicy }}
  # One container, tensorParallelSize ranks (rank r serves on port + r), so that all the
  # ranks see all the pod's GPUs (NVLink / P2P for NCCL) and restart as one group.
  command: ["pagedserve", "worker"]
  env:
    - name: PAGEDSERVE_HOST
      value: "0.0.0.0"
    - name: PAGEDSERVE_PORT
      value: {{ $.ctx.Values.engine.worker.port | quote }}
    - name: PAGEDSERVE_METRICS_PORT
      value: {{ $.ctx.Values.engine.worker.metricsPort | quote }}
    - name: PAGEDSERVE_TENSOR_PARALLEL_SIZE
      value: {{ $tp | quote }}
    - name: PAGEDSERVE_MODEL
      value: {{ $.ctx.Values.model.path | quote }}
    - name: PAGEDSERVE_DEVICE
      value: {{ $.ctx.Values.engine.worker.device | quote }}
    - name: PAGEDSERVE_DTYPE
      value: {{ $.ctx.Values.engine.worker.dtype | quote }}
    - name: PAGEDSERVE_BLOCK_SIZE
      value: {{ $.ctx.Values.engine.scheduler.blockSize | quote }}
    - name: PAGEDSERVE_KV_CACHE_MEMORY
      value: {{ $.ctx.Values.engine.worker.kvCacheMemory | quote }}
    - name: PAGEDSERVE_GPU_MEMORY_UTILIZATION
      value: {{ $.ctx.Values.engine.worker.gpuMemoryUtilization | quote }}
    - name: PAGEDSERVE_MAX_NUM_SEQS
      value: {{ $.ctx.Values.engine.scheduler.maxNumSeqs | quote }}
    - name: PAGEDSERVE_MAX_NUM_BATCHED_TOKENS
      value: {{ $.ctx.Values.engine.scheduler.maxNumBatchedTokens | quote }}
    {{- if $.ctx.Values.kvOffload.enabled }}
    - name: PAGEDSERVE_KV_OFFLOAD_DIR
      value: {{ $.ctx.Values.kvOffload.mountPath | quote }}
    {{- end }}
    {{- with $.ctx.Values.tracing.otlpTracesEndpoint }}
    - name: PAGEDSERVE_OTLP_TRACES_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    - name: PAGEDSERVE_LOG_LEVEL
      value: {{ $.ctx.Values.logLevel | quote }}
    - name: PAGEDSERVE_SHUTDOWN_TIMEOUT
      value: {{ $.ctx.Values.shutdownTimeout | quote }}
    {{- if $.multiHost }}
    {{- include "pagedserve.multiHostWorkerEnv" . | nindent 4 }}
    {{- end }}
    {{- with $.ctx.Values.engine.worker.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    {{- range $r := until $tp }}
    - name: {{ printf "grpc-rank%d" $r }}
      containerPort: {{ add (int $.ctx.Values.engine.worker.port) $r }}
      protocol: TCP
    {{- end }}
    - name: metrics-worker
      containerPort: {{ $.ctx.Values.engine.worker.metricsPort }}
      protocol: TCP
  # Startup and readiness: gRPC health "" of rank 0, SERVING once the model is loaded
  # (startup allows failureThreshold x periodSeconds for that); liveness: the health name
  # "liveness", SERVING while the process runs.
  startupProbe:
    grpc:
      port: {{ $.ctx.Values.engine.worker.port }}
    periodSeconds: {{ $.ctx.Values.engine.probes.startup.periodSeconds }}
    failureThreshold: {{ $.ctx.Values.engine.probes.startup.failureThreshold }}
  readinessProbe:
    grpc:
      port: {{ $.ctx.Values.engine.worker.port }}
    periodSeconds: {{ $.ctx.Values.engine.probes.readiness.periodSeconds }}
    failureThreshold: {{ $.ctx.Values.engine.probes.readiness.failureThreshold }}
  livenessProbe:
    grpc:
      port: {{ $.ctx.Values.engine.worker.port }}
      service: liveness
    periodSeconds: {{ $.ctx.Values.engine.probes.liveness.periodSeconds }}
    failureThreshold: {{ $.ctx.Values.engine.probes.liveness.failureThreshold }}
  {{- $res := deepCopy (default dict $.ctx.Values.engine.worker.resources) }}
  {{- if $.ctx.Values.engine.worker.gpu.enabled }}
  {{- $gpuName := $.ctx.Values.engine.worker.gpu.resourceName }}
  {{- $_ := set $res "limits" (merge (dict $gpuName $tp) (default dict $res.limits)) }}
  {{- $_ := set $res "requests" (merge (dict $gpuName $tp) (default dict $res.requests)) }}
  {{- end }}
  resources:
    {{- toYaml $res | nindent 4 }}
  securityContext:
    {{- toYaml $.ctx.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: dshm
      mountPath: /dev/shm
    - name: cache
      mountPath: /var/cache/pagedserve
    - name: tmp
      mountPath: /tmp
    {{- include "pagedserve.modelVolumeMount" $.ctx | nindent 4 }}
    {{- include "pagedserve.kvTierVolumeMount" $.ctx | nindent 4 }}
{{- end }}

{{/* The engine pods' volumes. */}}
{{- define "pagedserve.engineVolumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.engine.shm.sizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.engine.cache.sizeLimit }}
- name: tmp
  emptyDir: {}
{{- include "pagedserve.modelVolume" . }}
{{- include "pagedserve.kvTierVolume" . }}
{{- end }}

{{/* The KV tier on disk (values kvOffload): the worker writes and reads block files under
mountPath, the scheduler lists, stats and deletes them at the path the worker reports, so both
containers mount the volume at the same path. */}}
{{- define "pagedserve.kvTierVolumeMount" -}}
{{- if .Values.kvOffload.enabled }}
- name: kv-tier
  mountPath: {{ .Values.kvOffload.mountPath }}
{{- end }}
{{- end }}

{{/* The chart-made claim's name (kvOffload.persistence.create). */}}
{{- define "pagedserve.kvTierClaim" -}}
{{- printf "%s-kv-tier" (include "pagedserve.fullname" .) }}
{{- end }}

{{/* The KV tier's volume: kvOffload.existingClaim, else the chart's claim (shared by every
replica), else an emptyDir (per pod). Refuses the settings the services would refuse. */}}
{{- define "pagedserve.kvTierVolume" -}}
{{- $k := .Values.kvOffload }}
{{- if $k.enabled }}
{{- if not .Values.engine.scheduler.enablePrefixCaching }}
{{- fail "kvOffload.enabled needs engine.scheduler.enablePrefixCaching (the KV tier extends prefix-cache hits)" }}
{{- end }}
{{- if gt (int .Values.engine.pipelineParallelSize) 1 }}
{{- fail (printf "kvOffload.enabled does not work with engine.pipelineParallelSize %v (the worker refuses --kv-offload-dir with pipeline stages)" .Values.engine.pipelineParallelSize) }}
{{- end }}
{{- if and $k.existingClaim $k.persistence.create }}
{{- fail "kvOffload: set kvOffload.existingClaim or kvOffload.persistence.create, not both" }}
{{- end }}
- name: kv-tier
  {{- if $k.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $k.existingClaim }}
  {{- else if $k.persistence.create }}
  persistentVolumeClaim:
    claimName: {{ include "pagedserve.kvTierClaim" . }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- end }}

{{/* A multi-host engine pod's spec: the leader's (scheduler + worker) or a worker pod's. */}}
{{- define "pagedserve.enginePodSpec" -}}
{{- $ctx := .ctx }}
{{- $e := $ctx.Values.engine }}
serviceAccountName: {{ include "pagedserve.serviceAccountName" $ctx }}
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ include "pagedserve.gracePeriod" (dict "ctx" $ctx "component" "engine" "seconds" $e.terminationGracePeriodSeconds) }}
{{- with $ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $ctx.Values.podSecurityContext | nindent 2 }}
containers:
  {{- if .leader }}
  {{- include "pagedserve.schedulerContainer" (dict "ctx" $ctx "multiHost" true) | nindent 2 }}
  {{- end }}
  {{- include "pagedserve.workerContainer" (dict "ctx" $ctx "multiHost" true) | nindent 2 }}
volumes:
  {{- include "pagedserve.engineVolumes" $ctx | nindent 2 }}
{{- with $e.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $e.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $e.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
