{{/* The trainer pod, shared by the Job and the StatefulSet form (trainer.kind). */}}
{{- define "bucketrl.trainerPod" -}}
{{- $t := .Values.trainer -}}
{{- $name := printf "%s-trainer" (include "bucketrl.fullname" .) -}}
{{- $perPod := ternary (int $t.gpu.count) 1 $t.gpu.enabled -}}
{{- $nodes := int $t.nodes -}}
metadata:
  labels:
    {{- include "bucketrl.labels" (dict "ctx" $ "component" "trainer") | nindent 4 }}
  annotations:
    {{- if not .Values.run.existingConfigMap }}
    checksum/run-spec: {{ toJson .Values.run.spec | sha256sum }}
    {{- end }}
    {{- with $t.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  automountServiceAccountToken: false
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- include "bucketrl.podSecurityContext" . | nindent 2 }}
  restartPolicy: {{ ternary "Never" "Always" (eq $t.kind "Job") }}
  {{- if and (gt $nodes 1) (eq $t.kind "Job") }}
  # Pod i of the Indexed Job is <name>-i.<name>: pod 0 hosts the rendezvous.
  subdomain: {{ $name }}
  {{- end }}
  # SIGTERM -> finish the step, checkpoint, exit 0; the next pod resumes from that checkpoint.
  terminationGracePeriodSeconds: {{ $t.terminationGracePeriodSeconds }}
  containers:
    - name: trainer
      image: {{ include "bucketrl.image" (dict "ctx" $ "image" $t.image) }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      {{- if or (gt $perPod 1) (gt $nodes 1) }}
      # One trainer of nodes x gpu.count data-parallel ranks (bucketrl/trainer/distributed.py): torchrun, keeping
      # the trainer's exit codes. Rank 0 alone talks to the proxy.
      command: ["python", "-m", "bucketrl.trainer.launch"]
      args:
        - --nproc-per-node={{ $perPod }}
        {{- if gt $nodes 1 }}
        - --nnodes={{ $nodes }}
        - --rdzv-backend=c10d
        - --rdzv-endpoint={{ $name }}-0.{{ $name }}:{{ $t.rendezvousPort }}
        - --rdzv-id={{ .Values.run.id }}
        {{- else }}
        - --standalone
        {{- end }}
        - -m
        - bucketrl.cli
        - trainer
      {{- if gt $nodes 1 }}
      ports:
        - {name: rendezvous, containerPort: {{ $t.rendezvousPort }}}
      {{- end }}
      {{- else }}
      args: ["trainer"]
      {{- end }}
      env:
        {{- include "bucketrl.workerEnv" (dict "ctx" $ "role" "trainer") | nindent 8 }}
        - name: BUCKETRL_RUN_SPEC
          value: /etc/bucketrl/run/run-spec.json
        - name: BUCKETRL_WORK_DIR
          value: /cache/work
        - name: BUCKETRL_DEVICE
          value: {{ ternary "cuda" "cpu" $t.gpu.enabled | quote }}
        {{- if $t.shardBase }}
        - name: BUCKETRL_SHARD_BASE
          value: "true"
        {{- end }}
        {{- range $k, $v := $t.env }}
        - name: {{ $k }}
          value: {{ $v | toString | quote }}
        {{- end }}
        {{- with $t.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- include "bucketrl.containerSecurityContext" . | nindent 6 }}
      {{- include "bucketrl.resources" (dict "resources" $t.resources "gpu" $t.gpu) | nindent 6 }}
      volumeMounts:
        - {name: run-spec, mountPath: /etc/bucketrl/run, readOnly: true}
        - {name: cache, mountPath: /cache}
        - {name: tmp, mountPath: /tmp}
        {{- if gt $perPod 1 }}
        - {name: shm, mountPath: /dev/shm}
        {{- end }}
  volumes:
    - name: run-spec
      configMap:
        name: {{ include "bucketrl.runSpecConfigMap" . }}
        items: [{key: run-spec.json, path: run-spec.json}]
    - name: cache
      emptyDir: {sizeLimit: {{ $t.cache.sizeLimit }}}
    - name: tmp
      emptyDir: {sizeLimit: 10Gi}
    {{- if gt $perPod 1 }}
    - name: shm
      emptyDir: {medium: Memory, sizeLimit: {{ $t.shmSize }}}
    {{- end }}
  {{- with $t.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $t.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $t.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
