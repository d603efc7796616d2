{{/*
Chart name, truncated to 63 characters (DNS label).
*/}}
{{- define "fairbatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name prefix of every object: <release>-<chart> unless the release name already contains the chart name.
Kept to 52 characters so that "<fullname>-<component>-<ordinal>" still fits a 63-character DNS label.
*/}}
{{- define "fairbatch.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "fairbatch.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels. Call with the root context.
*/}}
{{- define "fairbatch.labels" -}}
helm.sh/chart: {{ include "fairbatch.chart" . }}
app.kubernetes.io/name: {{ include "fairbatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fairbatch
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels of one component. Call with (dict "root" $ "component" "router").
*/}}
{{- define "fairbatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fairbatch.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Common labels plus the component. Call with (dict "root" $ "component" "router").
*/}}
{{- define "fairbatch.componentLabels" -}}
{{ include "fairbatch.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Object names. */}}
{{- define "fairbatch.router.fullname" -}}{{ include "fairbatch.fullname" . }}-router{{- end }}
{{- define "fairbatch.config.fullname" -}}{{ include "fairbatch.fullname" . }}-config{{- end }}
{{- define "fairbatch.vllm.fullname" -}}{{ include "fairbatch.fullname" . }}-vllm{{- end }}
{{- define "fairbatch.agents.fullname" -}}{{ include "fairbatch.fullname" . }}-agents{{- end }}
{{- define "fairbatch.redis.fullname" -}}{{ include "fairbatch.fullname" . }}-redis{{- end }}

{{- define "fairbatch.router.serviceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "fairbatch.router.fullname" .) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Images: repository:tag, the tag defaulting to the chart appVersion. */}}
{{- define "fairbatch.router.image" -}}
{{- printf "%s:%s" .Values.router.image.repository (default .Chart.AppVersion .Values.router.image.tag) }}
{{- end }}
{{- define "fairbatch.agent.image" -}}
{{- printf "%s:%s" .Values.agent.image.repository (default .Chart.AppVersion .Values.agent.image.tag) }}
{{- end }}
{{- define "fairbatch.vllm.image" -}}
{{- printf "%s:%s" .Values.vllm.image.repository .Values.vllm.image.tag }}
{{- end }}

{{- define "fairbatch.servedModelName" -}}
{{- default .Values.vllm.model .Values.vllm.servedModelName }}
{{- end }}

{{/* "true" when the chart deploys its own Redis (redis.enabled, and no redis.existingUrl). */}}
{{- define "fairbatch.redisDeployed" -}}
{{- if and .Values.redis.enabled (not .Values.redis.existingUrl) }}true{{- end }}
{{- end }}

{{/*
Secrets the pods read (name and key): the router <-> agent token, always (security.agentTokenSecret, or the
chart's generated <fullname>-agent-token); the Redis password, when the routers send one (the chart's Redis
with redis.auth.enabled, or redis.auth.existingSecret for an existing Redis), else an empty name.
*/}}
{{- define "fairbatch.agentTokenSecretName" -}}
{{- default (printf "%s-agent-token" (include "fairbatch.fullname" .)) .Values.security.agentTokenSecret.name }}
{{- end }}
{{- define "fairbatch.redisPasswordSecretName" -}}
{{- $a := .Values.redis.auth }}
{{- if $a.existingSecret }}
{{- if or (include "fairbatch.redisDeployed" .) .Values.redis.existingUrl }}{{ $a.existingSecret }}{{ end }}
{{- else if and (include "fairbatch.redisDeployed" .) $a.enabled }}
{{- printf "%s-redis-auth" (include "fairbatch.fullname" .) }}
{{- end }}
{{- end }}

{{/*
The pods get their Secrets as files, never as environment variables (checkov CKV_K8S_35): each Secret key is
a read-only volume mounted at <secretsDir>/<volume>, the file <secretsDir>/<volume>/<key>, mode 0440 (owner
root, group the pod's fsGroup: the containers' non-root user reads it through that group). The processes read
it from the file that NAME_FILE names (fairbatch_common/secrets.py): FAIRBATCH_AGENT_TOKEN_FILE,
FAIRBATCH_REDIS_PASSWORD_FILE, FAIRBATCH_ENGINE_API_KEY_FILE.
*/}}
{{- define "fairbatch.secretsDir" -}}/var/run/secrets/fairbatch{{- end }}

{{/* The file of one Secret key: (dict "volume" VOLUME "key" KEY). */}}
{{- define "fairbatch.secretFile" -}}
{{- printf "/var/run/secrets/fairbatch/%s/%s" .volume .key }}
{{- end }}

{{/* The mount of one Secret volume (a volumeMounts item): (dict "volume" VOLUME). */}}
{{- define "fairbatch.secretMount" -}}
- {name: {{ .volume }}, mountPath: {{ printf "/var/run/secrets/fairbatch/%s" .volume }}, readOnly: true}
{{- end }}

{{/* One Secret volume with one key (a volumes item): (dict "volume" VOLUME "secret" NAME "key" KEY). */}}
{{- define "fairbatch.secretVolume" -}}
- name: {{ .volume }}
  secret:
    secretName: {{ .secret }}
    items:
      - {key: {{ .key }}, path: {{ .key }}}
    defaultMode: 288  # 0440: root and the pod's fsGroup may read it
{{- end }}

{{/*
data value (base64) for a generated Secret's key that survives upgrades: the value the Secret already holds
in the cluster (lookup), else a new random one. Call with (dict "root" $ "name" NAME "key" KEY).
Without cluster access (helm template) lookup finds nothing: a new value on every render.
*/}}
{{- define "fairbatch.keptRandomValue" -}}
{{- $old := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- if and $old $old.data (hasKey $old.data .key) }}
{{- index $old.data .key }}
{{- else }}
{{- randAlphaNum 48 | b64enc }}
{{- end }}
{{- end }}

{{/*
Redis URL for the router's shared counters, empty when Redis is off.
*/}}
{{- define "fairbatch.redisUrl" -}}
{{- if .Values.redis.existingUrl }}
{{- .Values.redis.existingUrl }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s.%s.svc.%s:%d/0" (include "fairbatch.redis.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.redis.port) }}
{{- end }}
{{- end }}

{{/*
The router's replica list as YAML: the StatefulSet's stable DNS names, or existingFleet.replicas.
*/}}
{{- define "fairbatch.replicaList" -}}
{{- $list := list }}
{{- if .Values.existingFleet.enabled }}
{{- $list = .Values.existingFleet.replicas }}
{{- else }}
{{- $sts := include "fairbatch.vllm.fullname" . }}
{{- $svc := include "fairbatch.agents.fullname" . }}
{{- range $i := until (int .Values.vllm.replicaCount) }}
{{- $id := printf "%s-%d" $sts $i }}
{{- $host := printf "%s.%s.%s.svc.%s" $id $svc $.Release.Namespace $.Values.clusterDomain }}
{{- $list = append $list (dict "id" $id "http_url" (printf "http://%s:%d" $host (int $.Values.agent.httpPort)) "grpc_target" (printf "%s:%d" $host (int $.Values.agent.grpcPort))) }}
{{- end }}
{{- end }}
{{- toYaml (dict "replicas" $list) }}
{{- end }}

{{/*
Discovery mode in effect: router.discovery.mode, except "static" for an existing fleet whose
headless Service is not named (router.discovery.service empty: existingFleet.replicas is used).
*/}}
{{- define "fairbatch.discoveryMode" -}}
{{- if and .Values.existingFleet.enabled (not .Values.router.discovery.service) }}static
{{- else }}{{ .Values.router.discovery.mode }}
{{- end }}
{{- end }}

{{/* Namespace and name of the agents' headless Service that discovery watches. */}}
{{- define "fairbatch.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.router.discovery.namespace }}
{{- end }}
{{- define "fairbatch.discoveryService" -}}
{{- default (include "fairbatch.agents.fullname" .) .Values.router.discovery.service }}
{{- end }}

{{/*
The router config's `discovery` section (YAML) for the kubernetes and dns modes.
*/}}
{{- define "fairbatch.discoveryConfig" -}}
{{- $ns := include "fairbatch.discoveryNamespace" . }}
{{- $svc := include "fairbatch.discoveryService" . }}
{{- toYaml (dict
      "mode" (include "fairbatch.discoveryMode" .)
      "namespace" $ns
      "service" $svc
      "http_port" (int .Values.agent.httpPort)
      "grpc_port" (int .Values.agent.grpcPort)
      "dns_name" (printf "%s.%s.svc.%s" $svc $ns .Values.clusterDomain)
      "resync_s" (int .Values.router.discovery.resyncSeconds)) }}
{{- end }}

{{/*
Cross-field checks the JSON schema cannot express; each fails the render with a readable message.
*/}}
{{- define "fairbatch.validate" -}}
{{- $cfg := include "fairbatch.baseConfig" . | fromYaml }}
{{- $classes := $cfg.slo_classes }}
{{- range $tenant, $t := $cfg.tenants }}
{{- if not (hasKey $classes $t.slo_class) }}
{{- fail (printf "config.tenants.%s.slo_class: %q is not one of config.slo_classes (%s)" $tenant $t.slo_class (keys $classes | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- range $hash, $tenant := .Values.auth.apiKeys }}
{{- if not (hasKey $cfg.tenants $tenant) }}
{{- fail (printf "auth.apiKeys.%s: tenant %q is not one of config.tenants (%s)" $hash $tenant (keys $cfg.tenants | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- if and .Values.agent.defaultSloClass (not (hasKey $classes .Values.agent.defaultSloClass)) }}
{{- fail (printf "agent.defaultSloClass: %q is not one of config.slo_classes (%s)" .Values.agent.defaultSloClass (keys $classes | sortAlpha | join ", ")) }}
{{- end }}
{{- range $k := list "replicas" "discovery" "api_keys" "redis_url" }}
{{- if hasKey $.Values.config $k }}
{{- fail (printf "config.%s is filled in by the chart; set %s instead" $k (get (dict "replicas" "vllm.replicaCount or existingFleet.replicas" "discovery" "router.discovery" "api_keys" "auth.apiKeys or auth.existingSecret" "redis_url" "redis.enabled or redis.existingUrl") $k)) }}
{{- end }}
{{- end }}
{{- if and .Values.existingFleet.enabled (not .Values.existingFleet.replicas) (not .Values.router.discovery.service) }}
{{- fail "existingFleet.enabled: list the replicas in existingFleet.replicas ({id, http_url, grpc_target} each), or name the fleet's headless Service in router.discovery.service" }}
{{- end }}
{{- if and .Values.existingFleet.enabled .Values.router.discovery.service (eq .Values.router.discovery.mode "static") }}
{{- fail "router.discovery.service is set but router.discovery.mode is static: use kubernetes or dns, or unset the service" }}
{{- end }}
{{- if eq (int .Values.router.metrics.port) (int .Values.router.port) }}
{{- fail (printf "router.metrics.port must differ from router.port (%d): metrics stay off the public port" (int .Values.router.port)) }}
{{- end }}
{{- if .Values.inferencePool.enabled }}
{{- if and .Values.existingFleet.enabled (not .Values.inferencePool.selector) }}
{{- fail "inferencePool.selector: with existingFleet, give the labels of your vLLM pods (the ones with the agent sidecar)" }}
{{- end }}
{{- if eq (include "fairbatch.discoveryMode" .) "static" }}
{{- fail "inferencePool.enabled: the picker names endpoints as pod IP:port, which static replicas (DNS names) are not; use router.discovery.mode kubernetes or dns" }}
{{- end }}
{{- if has (int .Values.inferencePool.pickerPort) (list (int .Values.router.port) (int .Values.router.metrics.port)) }}
{{- fail (printf "inferencePool.pickerPort (%d) must differ from router.port and router.metrics.port" (int .Values.inferencePool.pickerPort)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
.Values.config with the default SLO classes and tenant when none are given (YAML).
*/}}
{{- define "fairbatch.baseConfig" -}}
{{- $cfg := deepCopy .Values.config }}
{{- if not $cfg.slo_classes }}
{{- $_ := set $cfg "slo_classes" (dict
      "interactive" (dict "ttft_ms" 500 "tpot_ms" 50 "priority" 0 "sheddable" true "max_queue_ms" 2000)
      "batch" (dict "ttft_ms" 20000 "tpot_ms" 200 "priority" 1 "sheddable" false "max_queue_ms" 600000)) }}
{{- end }}
{{- if not $cfg.tenants }}
{{- $_ := set $cfg "tenants" (dict "default" (dict "weight" 1 "slo_class" (ternary "interactive" (keys $cfg.slo_classes | sortAlpha | first) (hasKey $cfg.slo_classes "interactive")))) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/*
The router's fairbatch.yaml. Call with (dict "root" $ "withKeys" true|false).
*/}}
{{- define "fairbatch.routerConfig" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $cfg := include "fairbatch.baseConfig" $root | fromYaml }}
{{- if and (not (hasKey $cfg "model")) (not $v.existingFleet.enabled) }}
{{- $_ := set $cfg "model" (include "fairbatch.servedModelName" $root) }}
{{- end }}
{{- if eq (include "fairbatch.discoveryMode" $root) "static" }}
{{- $_ := set $cfg "replicas" (get (include "fairbatch.replicaList" $root | fromYaml) "replicas") }}
{{- else }}
{{- $_ := set $cfg "discovery" (include "fairbatch.discoveryConfig" $root | fromYaml) }}
{{- end }}
{{- $http := deepCopy (default dict $cfg.http) }}
{{- $_ := set $http "metrics_port" (int $v.router.metrics.port) }}
{{- $_ := set $cfg "http" $http }}
{{- $redis := include "fairbatch.redisUrl" $root }}
{{- if $redis }}
{{- $_ := set $cfg "redis_url" $redis }}
{{- end }}
{{- $tel := deepCopy (default dict $cfg.telemetry) }}
{{- if $v.otel.endpoint }}
{{- $_ := set $tel "otlp_endpoint" $v.otel.endpoint }}
{{- end }}
{{- if $tel }}
{{- $_ := set $cfg "telemetry" $tel }}
{{- end }}
{{- if and .withKeys $v.auth.apiKeys }}
{{- $_ := set $cfg "api_keys" $v.auth.apiKeys }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* True ("true") when the router reads its config from a chart-rendered Secret (inline API keys). */}}
{{- define "fairbatch.configInSecret" -}}
{{- if and .Values.auth.apiKeys (not .Values.auth.existingSecret) }}true{{- end }}
{{- end }}

{{/*
PromQL: the raw desired number of vLLM replicas by the PAB rule (router/autoscale.py pab_desired):
the ready replicas, +1 when the router refused requests for capacity in the last minute or requests
queue while no replica has PAB for the class, -1 when the spare PAB exceeds one idle replica's
horizon (ttft_ms - min(agent.marginFrac x ttft_ms, agent.marginCapTpots x tpot_ms), as
replica_agent/policy/pab.py planning_horizon_ms) and nothing queues. An HPA with an AverageValue target
of 1 runs that many replicas; its scale-down stabilization holds a replica while it starts.
*/}}
{{- define "fairbatch.vllmDesiredReplicasQuery" -}}
{{- $as := .Values.vllm.autoscaling }}
{{- $classes := (include "fairbatch.baseConfig" . | fromYaml).slo_classes }}
{{- $cls := index $classes $as.sloClass }}
{{- $m := minf (mulf (float64 $cls.ttft_ms) (float64 .Values.agent.marginFrac)) (mulf (float64 $cls.tpot_ms) (float64 .Values.agent.marginCapTpots)) }}
{{- $h := divf (subf (float64 $cls.ttft_ms) $m) 1000.0 }}
{{- $ns := printf "namespace=%q" .Release.Namespace }}
{{- $pab := printf "fairbatch_router_fleet_pab_seconds{%s,slo_class=%q}" $ns $as.sloClass }}
{{- $queue := printf "(sum(fairbatch_router_queue_depth{%s}) or vector(0))" $ns -}}
(max(fairbatch_router_replicas{ {{- $ns -}} }) or vector(0))
+ clamp_max(
    ((sum(increase(fairbatch_router_requests_total{ {{- $ns -}} ,outcome=~"slo_infeasible|queue_full|queue_timeout|work_shed"}[1m])) or vector(0)) > bool 0)
  + (({{ $queue }} > bool 0) * ((max({{ $pab }}) or vector(0)) <= bool 0)),
  1)
- ((min({{ $pab }}) or vector(0)) > bool {{ $h }}) * ({{ $queue }} == bool 0)
{{- end }}

{{/*
Gateway API Inference Extension (inferencePool.*): the pool's name, the picker Service, the pool's selector
(the chart's replica pods, or inferencePool.selector) and its endpoints' port (the agent's HTTP port).
*/}}
{{- define "fairbatch.inferencePool.name" -}}
{{- default (include "fairbatch.fullname" .) .Values.inferencePool.name }}
{{- end }}
{{- define "fairbatch.picker.fullname" -}}{{ include "fairbatch.fullname" . }}-picker{{- end }}
{{- define "fairbatch.inferencePool.selector" -}}
{{- if .Values.inferencePool.selector }}
{{- toYaml .Values.inferencePool.selector }}
{{- else }}
{{- include "fairbatch.selectorLabels" (dict "root" . "component" "replica") }}
{{- end }}
{{- end }}
{{- define "fairbatch.inferencePool.targetPort" -}}
{{- int (default .Values.agent.httpPort .Values.inferencePool.targetPort) }}
{{- end }}
