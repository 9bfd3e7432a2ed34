{{/* Names ---------------------------------------------------------------------------------------------- */}}

{{- define "bucketrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name prefix; leaves room for the longest suffix ("-generator", 10 chars) within 63. */}}
{{- define "bucketrl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "bucketrl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels: call with (dict "ctx" $ "component" "proxy") */}}
{{- define "bucketrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bucketrl.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "bucketrl.labels" -}}
helm.sh/chart: {{ include "bucketrl.chart" .ctx }}
{{ include "bucketrl.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: bucketrl
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Images ---------------------------------------------------------------------------------------------- */}}

{{/* (dict "ctx" $ "image" .Values.proxy.image) -> repository/name:tag or repository/name@digest */}}
{{- define "bucketrl.image" -}}
{{- $repo := printf "%s/%s" (trimSuffix "/" .ctx.Values.image.repository) .image.name }}
{{- if .image.digest }}
{{- printf "%s@%s" $repo .image.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .ctx.Chart.AppVersion .ctx.Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "bucketrl.redisImage" -}}
{{- $i := .Values.redis.image }}
{{- if $i.digest }}
{{- printf "%s:%s@%s" $i.repository $i.tag $i.digest }}
{{- else }}
{{- printf "%s:%s" $i.repository $i.tag }}
{{- end }}
{{- end }}

{{/* Secrets, addresses ----------------------------------------------------------------------------------- */}}

{{- define "bucketrl.tokensSecret" -}}
{{- default (printf "%s-tokens" (include "bucketrl.fullname" .)) .Values.secrets.tokens.existingSecret }}
{{- end }}

{{- define "bucketrl.s3Secret" -}}
{{- default (printf "%s-s3" (include "bucketrl.fullname" .)) .Values.secrets.s3.existingSecret }}
{{- end }}

{{- define "bucketrl.redisSecret" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.existingSecret }}
{{- .Values.redis.external.existingSecret }}
{{- else }}
{{- printf "%s-redis" (include "bucketrl.fullname" .) }}
{{- end }}
{{- end }}

{{- define "bucketrl.runSpecConfigMap" -}}
{{- default (printf "%s-run-spec" (include "bucketrl.fullname" .)) .Values.run.existingConfigMap }}
{{- end }}

{{/* The proxy URL workers use: proxyUrl if given, else this release's proxy Service. */}}
{{- define "bucketrl.proxyUrl" -}}
{{- if .Values.proxyUrl }}
{{- .Values.proxyUrl | trimSuffix "/" }}
{{- else if .Values.proxy.enabled }}
{{- printf "http://%s-proxy:%d" (include "bucketrl.fullname" .) (int .Values.proxy.service.port) }}
{{- else }}
{{- fail "proxy.enabled=false: set proxyUrl to the address of the proxy the workers should use" }}
{{- end }}
{{- end }}

{{/* This release's regional relay Service (relay.enabled). */}}
{{- define "bucketrl.relayUrl" -}}
{{- printf "%s://%s-relay:%d" (ternary "https" "http" (not (empty .Values.relay.tls.secretName))) (include "bucketrl.fullname" .) (int .Values.relay.service.port) }}
{{- end }}

{{/* The private CA (caSecret) the relay and the generators verify the home proxy with: env, mount, volume. */}}
{{- define "bucketrl.caEnv" -}}
{{- if .Values.caSecret.name }}
- name: BUCKETRL_CA_FILE
  value: /etc/bucketrl/ca/{{ .Values.caSecret.key }}
{{- end }}
{{- end }}
{{- define "bucketrl.caMount" -}}
{{- if .Values.caSecret.name }}
- {name: ca, mountPath: /etc/bucketrl/ca, readOnly: true}
{{- end }}
{{- end }}
{{- define "bucketrl.caVolume" -}}
{{- if .Values.caSecret.name }}
- name: ca
  secret:
    secretName: {{ .Values.caSecret.name }}
    items: [{key: {{ .Values.caSecret.key }}, path: {{ .Values.caSecret.key }}}]
{{- end }}
{{- end }}

{{- define "bucketrl.proxyServiceAccount" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-proxy" (include "bucketrl.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A token: the value given, else the one already in the cluster's Secret (kept on upgrade), else a new one.
     (dict "ctx" $ "key" "admin") */}}
{{- define "bucketrl.token" -}}
{{- $given := index .ctx.Values.secrets.tokens .key }}
{{- if $given }}
{{- $given }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace (printf "%s-tokens" (include "bucketrl.fullname" .ctx)) }}
{{- $old := dig "data" .key "" ($existing | default dict) }}
{{- if $old }}{{ $old | b64dec }}{{ else }}{{ randAlphaNum 40 }}{{ end }}
{{- end }}
{{- end }}

{{/* Pod and container fragments -------------------------------------------------------------------------- */}}

{{- define "bucketrl.podSecurityContext" -}}
securityContext:
{{ toYaml .Values.podSecurityContext | indent 2 }}
{{- end }}

{{- define "bucketrl.containerSecurityContext" -}}
securityContext:
{{ toYaml .Values.containerSecurityContext | indent 2 }}
{{- end }}

{{/* Worker environment shared by trainer and generators: (dict "ctx" $ "role" "trainer") */}}
{{- define "bucketrl.workerEnv" -}}
{{- if and (eq .role "generator") .ctx.Values.relay.enabled }}
{{- /* The region's relay first, the home proxy second (the generators' fallback while the relay is down). The
       relay's Service is reached over the pod network in plain HTTP unless relay.tls is set; the home proxy's URL must be
       https:// (relay.yaml refuses anything else), so no token crosses clouds unencrypted. */}}
- name: BUCKETRL_PROXY_URL
  value: {{ printf "%s,%s" (include "bucketrl.relayUrl" .ctx) (include "bucketrl.proxyUrl" .ctx) | quote }}
{{- if not .ctx.Values.relay.tls.secretName }}
- name: BUCKETRL_INSECURE_HTTP
  value: "1"
{{- end }}
{{- else }}
- name: BUCKETRL_PROXY_URL
  value: {{ include "bucketrl.proxyUrl" .ctx | quote }}
{{- end }}
{{- if and (not .ctx.Values.proxyUrl) .ctx.Values.proxy.enabled }}
{{- /* This release's proxy Service over plain HTTP, on purpose: the traffic stays on the cluster's pod network.
       A proxyUrl given by the user is never exempted: http:// to a remote host is refused by the workers. */}}
- name: BUCKETRL_INSECURE_HTTP
  value: "1"
{{- end }}
- name: BUCKETRL_RUN
  value: {{ .ctx.Values.run.id | quote }}
- name: BUCKETRL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "bucketrl.tokensSecret" .ctx }}
      key: {{ index .ctx.Values.secrets.tokens.keys .role }}
- name: BUCKETRL_WORKER_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}

{{/* Accelerator resources merged into requests/limits: (dict "resources" .Values.x.resources "gpu" .Values.x.gpu) */}}
{{- define "bucketrl.resources" -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- if .gpu.enabled -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits .gpu.resourceName (int .gpu.count) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
resources:
{{ toYaml $res | indent 2 }}
{{- end }}
