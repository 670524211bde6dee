// The talk page: this browser becomes a voice device of the bridge (docs/console.md, "Talk").
//
// POST /api/console/talk buys a one-use ticket with the key; the page opens the device
// WebSocket /console/device?ticket=... on its own origin and speaks the stock device protocol:
// hello (Opus 16 kHz 60 ms through WebCodecs, or PCM16 where WebCodecs cannot), listen
// start/stop, abort, binary protocol version 1 (one packet per message), and MCP envelopes
// answered by a tiny MCP server of the page (device status, speaker volume = playback gain).
//
// Beyond the stock protocol: the ticket says whether the bridge hears speech (`voice`); without
// voice the page never captures or streams audio, says why, and offers typed messages (`listen
// detect` with text, answered in text). The bridge sends `tool_call` messages for the tool calls
// of this device's own turns, shown under the turn in the transcript.

import { api, announce, can, el, formatMs, lacksScope, startPage } from "/console/common.js";
import { strings } from "/console/i18n.js";
import TEXT from "/console/text/talk.js";

const T = strings(TEXT);

const RATE = 16000; // uplink: what the stock device sends
const FRAME_MS = 60;
const FRAME_SAMPLES = (RATE * FRAME_MS) / 1000;
const VOICE_RMS = 0.01; // about -40 dBFS: a frame above it counts as speech (for the figures)
const MAX_LINES = 200; // transcript lines kept on the page
const PLAYBACK_LEAD_S = 0.05; // the first frame of an answer waits this long for the next ones
const MAX_TYPED_CHARS = 4000; // what the bridge takes as one question (MAX_QUERY_CHARS)
const MAX_ARGUMENTS_CHARS = 200; // a tool call's arguments shown in the transcript
const VOICE_UNAVAILABLE = "voice unavailable"; // the bridge's alert status when it has no voice
const OPUS_CONFIG = {
  codec: "opus",
  sampleRate: RATE,
  numberOfChannels: 1,
  bitrate: 24000,
  opus: { frameDuration: FRAME_MS * 1000 },
};
const STATUS_TOOL = "self.get_device_status";
const VOLUME_TOOL = "self.audio_speaker.set_volume";
const TOOLS = [
  {
    name: STATUS_TOOL,
    description: "Get the device status (speaker volume, microphone, audio format).",
    inputSchema: { type: "object", properties: {} },
  },
  {
    name: VOLUME_TOOL,
    description: "Set the volume of the audio speaker (0 to 100).",
    inputSchema: {
      type: "object",
      properties: { volume: { type: "integer", minimum: 0, maximum: 100 } },
      required: ["volume"],
    },
  },
];

// ---- what the tests and the benchmark read (a copy each time: read-only) -----------------------

const stats = {
  uplinkFormat: null,
  downlinkFormat: null,
  downlinkRate: null,
  connected: false,
  state: "idle",
  framesSent: 0,
  framesReceived: 0,
  audioPlayedMs: 0,
  volume: 70,
  voice: null, // {available, reason} from the ticket, or from the bridge's alert
  transcripts: [],
  sentences: [],
  toolCalls: [], // every `tool_call` message: {tool, server, arguments, outcome, durationMs, error}
  turns: [], // finished turns, as `newTurn` describes them
  errors: [],
};
Object.defineProperty(window, "talkStats", {
  get: () => JSON.parse(JSON.stringify(stats)),
});

// ---- the page ----------------------------------------------------------------------------------

startPage(T.title, (main, me) => {
  if (!can(me, "console:talk")) {
    lacksScope(main, "console:talk");
    return;
  }
  new TalkPage(main).render();
});

class TalkPage {
  constructor(main) {
    this.main = main;
    this.socket = null;
    this.sessionId = "";
    this.deviceId = null;
    this.connecting = null; // the promise of a connection in progress
    this.mode = null; // "manual" | "auto" while listening
    this.state = "idle"; // idle | listening | thinking | speaking
    this.handsFree = false;
    this.microphone = null; // {stream, context, node}
    this.encoder = null;
    this.uplinkFormat = null;
    this.downlink = { format: "opus", rate: 24000, frameDuration: FRAME_MS };
    this.player = null; // {context, gain}
    this.decoder = null;
    this.scheduled = new Set(); // AudioBufferSourceNodes not yet finished
    this.nextStart = 0;
    this.turn = null;
    this.lastVoiceAt = null;
    this.volume = 70;
    this.assistantLine = null;
    this.toolAnchor = null; // the transcript line the turn's next tool call goes after
    this.voiceOff = null; // why the bridge hears no speech (null: it does, or not known yet)
  }

  render() {
    this.status = el("p", { id: "talk-status", class: "talk-status", role: "status", text: T.notConnected });
    this.connectButton = el("button", { type: "button", text: T.connect, on: { click: () => this.toggleConnection() } });
    this.talkButton = el("button", {
      type: "button",
      id: "talk-hold",
      class: "talk-hold",
      text: T.holdToTalk,
      "aria-describedby": "talk-hold-help",
      on: {
        pointerdown: (event) => this.pressStart(event),
        pointerup: () => this.pressEnd(),
        pointerleave: () => this.pressEnd(),
        pointercancel: () => this.pressEnd(),
        contextmenu: (event) => event.preventDefault(),
      },
    });
    this.autoButton = el("button", {
      type: "button",
      class: "secondary",
      text: T.handsFree,
      "aria-pressed": "false",
      on: { click: () => this.toggleHandsFree() },
    });
    this.abortButton = el("button", { type: "button", class: "danger", text: T.stopAnswer, on: { click: () => this.abort() } });
    this.volumeInput = el("input", {
      id: "talk-volume",
      type: "range",
      min: "0",
      max: "100",
      step: "1",
      value: String(this.volume),
      on: { input: () => this.setVolume(Number(this.volumeInput.value), false) },
    });
    this.micNote = el("p", { id: "talk-mic", class: "hint" });
    // Shown once the bridge says it has no voice (the ticket, or its alert).
    this.voiceNote = el("p", { id: "talk-voice", class: "notice", hidden: true });
    this.typedInput = el("input", {
      id: "talk-text",
      type: "text",
      maxlength: String(MAX_TYPED_CHARS),
      autocomplete: "off",
      "aria-describedby": "talk-text-help",
    });
    this.typedForm = el(
      "form",
      { class: "talk-type", on: { submit: (event) => this.sendTyped(event) } },
      el("label", { for: "talk-text", text: T.typeMessage }),
      el("div", { class: "row" }, this.typedInput, el("button", { type: "submit", text: T.send })),
      el("p", { id: "talk-text-help", class: "hint", text: T.typedHelp }),
    );
    // The live region wraps the list: a role on the <ol> itself would hide its items' list role.
    // It scrolls once the turns fill it: focusable, so a keyboard can scroll it too.
    this.log = el("ol", { class: "talk-log", tabindex: "0" });
    const transcript = el("div", { id: "talk-transcript", role: "log", "aria-live": "polite", "aria-label": T.transcriptLabel }, this.log);
    this.main.replaceChildren(
      el(
        "section",
        { class: "card", "aria-labelledby": "talk-title" },
        el("h1", { id: "talk-title", text: T.heading }),
        el("p", {
          class: "hint",
          text: T.intro,
        }),
        this.status,
        this.voiceNote,
        el("div", { class: "row talk-controls" }, this.connectButton, this.talkButton, this.autoButton, this.abortButton),
        el("p", { id: "talk-hold-help", class: "hint", text: T.holdHelp }),
        el("div", { class: "row" }, el("label", { for: "talk-volume", text: T.volume }), this.volumeInput),
        this.micNote,
        this.typedForm,
      ),
      el("section", { class: "card", "aria-labelledby": "talk-log-title" }, el("h2", { id: "talk-log-title", text: T.transcript }), transcript),
    );
    document.addEventListener("keydown", (event) => this.keyStart(event));
    document.addEventListener("keyup", (event) => this.keyEnd(event));
    this.describeMicrophone();
    this.updateControls();
  }

  // ---- status ----

  say(text, kind = "") {
    this.status.textContent = text;
    this.status.className = `talk-status ${kind}`.trim();
  }

  fail(text) {
    stats.errors.push(text);
    this.say(text, "error");
    announce(text);
  }

  describeMicrophone() {
    const capture = Boolean(navigator.mediaDevices && navigator.mediaDevices.getUserMedia && window.AudioWorkletNode);
    const codec = "AudioEncoder" in window ? T.codecOpus : T.codecPcm;
    this.micNote.textContent = capture
      ? T.micAudio(codec)
      : T.noMicrophone;
    this.hasCapture = capture;
  }

  updateControls() {
    const connected = Boolean(this.socket && this.socket.readyState === WebSocket.OPEN);
    const speech = this.hasCapture && !this.voiceOff;
    this.connectButton.textContent = connected ? T.disconnect : T.connect;
    this.talkButton.disabled = !speech || this.handsFree;
    this.autoButton.disabled = !speech;
    this.autoButton.setAttribute("aria-pressed", String(this.handsFree));
    this.autoButton.textContent = this.handsFree ? T.handsFreeOn : T.handsFree;
    this.abortButton.disabled = !connected || this.state === "idle";
    this.talkButton.classList.toggle("active", this.state === "listening" && this.mode === "manual");
  }

  setState(state) {
    this.state = state;
    stats.state = state;
    const words = {
      idle: this.voiceOff ? T.idleNoVoice : this.handsFree ? T.idleHandsFree : T.idle,
      listening: T.listening,
      thinking: T.thinking,
      speaking: this.voiceOff ? T.answering : T.speaking,
    };
    this.say(words[state] || state, state === "listening" ? "live" : "");
    this.updateControls();
  }

  // ---- connection ----

  async toggleConnection() {
    if (this.socket) {
      this.disconnect(T.disconnected);
      return;
    }
    try {
      await this.connect();
    } catch (error) {
      this.fail(T.cannotConnect(error.message));
    }
  }

  connect() {
    if (this.socket && this.socket.readyState === WebSocket.OPEN) return Promise.resolve();
    if (!this.connecting) {
      this.connecting = this.open().finally(() => {
        this.connecting = null;
      });
    }
    return this.connecting;
  }

  async open() {
    this.say(T.connecting);
    this.ensurePlayer(); // inside the click: browsers start audio only after a gesture
    this.uplinkFormat = await chooseFormat();
    stats.uplinkFormat = this.uplinkFormat;
    const ticket = await api("/api/console/talk", { method: "POST" });
    this.deviceId = ticket.device_id;
    // A bridge that does not say (an older one) is taken to hear: its alert says otherwise.
    if (ticket.voice && ticket.voice.available === false) this.voiceUnavailable(ticket.voice.reason);
    else this.voiceAvailable();
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const url = `${scheme}//${location.host}${ticket.path}?ticket=${encodeURIComponent(ticket.ticket)}`;
    const socket = new WebSocket(url);
    socket.binaryType = "arraybuffer";
    this.socket = socket;
    await new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(T.noAnswer)), 10000);
      socket.addEventListener("open", () => {
        socket.send(JSON.stringify(this.hello()));
      });
      socket.addEventListener("message", (event) => {
        if (typeof event.data === "string" && !this.sessionId) {
          const message = parse(event.data);
          if (message && message.type === "hello") {
            clearTimeout(timer);
            this.onServerHello(message);
            resolve();
            return;
          }
        }
        this.onMessage(event);
      });
      socket.addEventListener("close", (event) => {
        clearTimeout(timer);
        reject(new Error(event.reason || T.closed(event.code)));
        this.onClosed(socket, event);
      });
    });
  }

  hello() {
    return {
      type: "hello",
      version: 1,
      features: { mcp: true },
      transport: "websocket",
      audio_params: { format: this.uplinkFormat, sample_rate: RATE, channels: 1, frame_duration: FRAME_MS },
    };
  }

  onServerHello(message) {
    this.sessionId = typeof message.session_id === "string" ? message.session_id : "";
    const params = message.audio_params || {};
    this.downlink = {
      format: params.format === "pcm16" ? "pcm16" : "opus",
      rate: Number.isInteger(params.sample_rate) && params.sample_rate > 0 ? params.sample_rate : 24000,
      frameDuration: Number.isInteger(params.frame_duration) ? params.frame_duration : FRAME_MS,
    };
    stats.connected = true;
    stats.downlinkFormat = this.downlink.format;
    stats.downlinkRate = this.downlink.rate;
    this.setState("idle");
    const how = this.voiceOff ? T.textOnly : T.audio(this.uplinkFormat === "opus" ? "Opus" : "PCM16");
    this.say(T.connectedAs(this.deviceId, how), "ok");
    announce(T.connected);
  }

  voiceAvailable() {
    this.voiceOff = null;
    stats.voice = { available: true, reason: null };
    this.voiceNote.hidden = true;
    this.voiceNote.textContent = "";
    this.talkButton.setAttribute("aria-describedby", "talk-hold-help");
    this.autoButton.removeAttribute("aria-describedby");
    this.updateControls();
  }

  // The bridge hears no speech (voice off, its packages missing): no capture, no audio sent;
  // the buttons that would listen are disabled and the note says why. Typing still works.
  voiceUnavailable(reason) {
    const why = String(reason || T.noSpeech);
    const first = !this.voiceOff;
    this.voiceOff = why;
    stats.voice = { available: false, reason: why };
    this.handsFree = false;
    this.pressed = false;
    this.stopCapture();
    if (this.state === "listening") {
      if (this.turn) this.turn = null; // nothing was heard: no turn to report
      this.setState("idle");
    }
    this.voiceNote.textContent = T.voiceUnavailable(why);
    this.voiceNote.hidden = false;
    this.talkButton.setAttribute("aria-describedby", "talk-hold-help talk-voice");
    this.autoButton.setAttribute("aria-describedby", "talk-voice");
    this.updateControls();
    if (first) announce(T.typeInstead);
  }

  onClosed(socket, event) {
    if (socket !== this.socket) return;
    this.socket = null;
    this.sessionId = "";
    stats.connected = false;
    this.stopCapture();
    this.stopPlayback();
    this.state = "idle";
    const text =
      event.code === 1000 ? T.disconnected : event.reason ? T.disconnectedWhy(event.code, event.reason) : T.disconnectedCode(event.code);
    this.say(this.handsFree ? T.talkAgain(text) : text);
    this.handsFree = false;
    this.updateControls();
  }

  disconnect(text) {
    this.handsFree = false;
    if (this.socket) this.socket.close(1000, "closed by the page");
    this.say(text);
  }

  send(message) {
    if (!this.socket || this.socket.readyState !== WebSocket.OPEN) return;
    this.socket.send(JSON.stringify({ session_id: this.sessionId, ...message }));
  }

  // ---- listening ----

  async startListening(mode) {
    try {
      await this.connect();
      if (this.voiceOff) {
        // Nobody would hear it: the microphone is never opened.
        this.handsFree = false;
        this.updateControls();
        announce(T.typeInstead);
        return false;
      }
      await this.startCapture();
    } catch (error) {
      this.fail(microphoneProblem(error));
      this.handsFree = false;
      this.updateControls();
      return false;
    }
    if (this.state === "speaking" || this.state === "thinking") {
      this.send({ type: "abort" }); // talking over the answer: it stops, as on the device
      this.stopPlayback();
    }
    this.mode = mode;
    this.turn = newTurn(false);
    this.lastVoiceAt = null;
    this.send({ type: "listen", state: "start", mode });
    this.setState("listening");
    return true;
  }

  stopListening() {
    if (this.state !== "listening") return;
    this.send({ type: "listen", state: "stop" });
    if (this.turn && this.mode === "manual") this.turn.speechEndAt = performance.now();
    this.setState("thinking");
  }

  pressStart(event) {
    if (event.button !== undefined && event.button !== 0) return;
    if (this.handsFree || this.pressed) return;
    this.pressed = true;
    // The release counts even off the button (a finger that slid away).
    if (event.pointerId !== undefined) this.talkButton.setPointerCapture(event.pointerId);
    this.startListening("manual");
  }

  pressEnd() {
    if (!this.pressed) return;
    this.pressed = false;
    this.stopListening();
  }

  keyStart(event) {
    if (event.code !== "Space" || event.repeat || event.defaultPrevented) return;
    const target = event.target;
    // Space still types in fields and presses the other buttons.
    if (target !== this.talkButton && target instanceof Element && target.closest("input, textarea, select, button, a")) return;
    event.preventDefault();
    if (!this.hasCapture || this.voiceOff) return;
    this.pressStart({});
  }

  // ---- typed messages (what a stock device sends as `listen detect` text) ----

  async sendTyped(event) {
    event.preventDefault();
    const text = this.typedInput.value.trim();
    if (!text) return;
    try {
      await this.connect();
    } catch (error) {
      this.fail(T.cannotConnect(error.message));
      return;
    }
    if (this.state !== "idle") {
      // The typed words are the question: what was heard so far is dropped (not cut into an
      // utterance of its own) and an answer under way stops, as speaking over it does. A
      // hands-free page listens again after the answer.
      this.send({ type: "abort" });
      this.stopPlayback();
      this.setState("idle");
    }
    this.turn = newTurn(true);
    this.send({ type: "listen", state: "detect", text });
    this.typedInput.value = "";
    // "Thinking…" comes with the bridge's `stt`: text it ignores (a wake word) leaves no
    // turn waiting.
  }

  keyEnd(event) {
    if (event.code !== "Space" || !this.pressed) return;
    event.preventDefault();
    this.pressEnd();
  }

  async toggleHandsFree() {
    if (this.handsFree) {
      this.handsFree = false;
      // Listening ends here; an answer under way plays to its end (Stop answer cuts it).
      if (this.state === "listening") {
        this.send({ type: "abort" });
        this.setState("idle");
      } else {
        this.updateControls();
      }
      announce(T.handsFreeOff);
      return;
    }
    this.handsFree = true;
    this.updateControls();
    if (await this.startListening("auto")) announce(T.handsFreeStarted);
  }

  abort() {
    this.send({ type: "abort" });
    this.stopPlayback();
    if (this.turn) this.turn.stoppedAt = performance.now();
    if (this.handsFree) this.startListening("auto");
    else this.setState("idle");
  }

  // ---- microphone ----

  async startCapture() {
    if (this.microphone) return;
    if (!this.hasCapture) throw new Error(T.noMicrophoneHere);
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    let context;
    try {
      context = new AudioContext({ sampleRate: RATE });
    } catch {
      context = new AudioContext(); // resampled in the worklet instead
    }
    await context.audioWorklet.addModule("/console/talk-capture.js");
    const source = context.createMediaStreamSource(stream);
    const node = new AudioWorkletNode(context, "talk-capture", {
      numberOfInputs: 1,
      numberOfOutputs: 0,
      channelCount: 1,
      channelCountMode: "explicit",
      processorOptions: { frameSamples: FRAME_SAMPLES },
    });
    node.port.onmessage = (event) => this.onFrame(event.data);
    source.connect(node);
    await context.resume();
    this.microphone = { stream, context, node };
    if (this.uplinkFormat === "opus") this.encoder = this.makeEncoder();
  }

  stopCapture() {
    if (!this.microphone) return;
    const { stream, context, node } = this.microphone;
    node.port.onmessage = null;
    for (const track of stream.getTracks()) track.stop();
    context.close();
    this.microphone = null;
    if (this.encoder && this.encoder.state !== "closed") this.encoder.close();
    this.encoder = null;
  }

  makeEncoder() {
    const encoder = new AudioEncoder({
      output: (chunk) => {
        const packet = new Uint8Array(chunk.byteLength);
        chunk.copyTo(packet);
        this.sendAudio(packet);
      },
      error: (error) => this.fail(T.encoderError(error.message)),
    });
    encoder.configure(OPUS_CONFIG);
    this.encodedSamples = 0;
    return encoder;
  }

  onFrame(samples) {
    if (this.state !== "listening") return;
    if (rms(samples) > VOICE_RMS) {
      this.lastVoiceAt = performance.now();
      if (this.turn) this.turn.speechEndAt = this.lastVoiceAt;
    }
    if (this.uplinkFormat === "pcm16") {
      this.sendAudio(toPcm16(samples));
      return;
    }
    const data = new AudioData({
      format: "f32",
      sampleRate: RATE,
      numberOfFrames: samples.length,
      numberOfChannels: 1,
      timestamp: Math.round((this.encodedSamples * 1e6) / RATE),
      data: samples,
    });
    this.encodedSamples += samples.length;
    this.encoder.encode(data);
    data.close();
  }

  sendAudio(bytes) {
    if (this.state !== "listening" || !this.socket || this.socket.readyState !== WebSocket.OPEN) return;
    this.socket.send(bytes);
    stats.framesSent += 1;
  }

  // ---- speaker ----

  ensurePlayer() {
    if (this.player) {
      this.player.context.resume();
      return;
    }
    const context = new AudioContext();
    const gain = context.createGain();
    gain.gain.value = this.volume / 100;
    gain.connect(context.destination);
    context.resume();
    this.player = { context, gain };
  }

  resetDecoder() {
    if (this.decoder && this.decoder.state !== "closed") this.decoder.close();
    this.decoder = null;
    if (this.downlink.format !== "opus") return;
    this.decoder = new AudioDecoder({
      output: (audio) => this.playDecoded(audio),
      error: (error) => this.fail(T.decoderError(error.message)),
    });
    this.decoder.configure({ codec: "opus", sampleRate: this.downlink.rate, numberOfChannels: 1 });
    this.decodedFrames = 0;
  }

  onAudio(buffer) {
    if (this.state !== "speaking") return; // audio outside tts start/stop is not played
    stats.framesReceived += 1;
    if (this.turn) {
      this.turn.framesReceived += 1;
      if (this.turn.firstFrameAt === null) this.turn.firstFrameAt = performance.now();
    }
    const bytes = new Uint8Array(buffer);
    if (this.downlink.format === "pcm16") {
      this.schedule(fromPcm16(bytes), this.downlink.rate);
      return;
    }
    if (!this.decoder) this.resetDecoder();
    const duration = this.downlink.frameDuration * 1000;
    this.decoder.decode(new EncodedAudioChunk({ type: "key", timestamp: this.decodedFrames * duration, duration, data: bytes }));
    this.decodedFrames += 1;
  }

  playDecoded(audio) {
    const samples = new Float32Array(audio.numberOfFrames);
    audio.copyTo(samples, { planeIndex: 0, format: "f32-planar" });
    const rate = audio.sampleRate;
    audio.close();
    if (this.state === "speaking") this.schedule(samples, rate);
  }

  schedule(samples, rate) {
    if (!samples.length) return;
    const { context, gain } = this.player;
    const buffer = context.createBuffer(1, samples.length, rate);
    buffer.copyToChannel(samples, 0);
    const source = context.createBufferSource();
    source.buffer = buffer;
    source.connect(gain);
    const now = context.currentTime;
    const first = this.nextStart < now;
    const start = first ? now + PLAYBACK_LEAD_S : this.nextStart;
    source.start(start);
    this.nextStart = start + buffer.duration;
    const turn = this.turn;
    if (turn && turn.firstAudioAt === null) turn.firstAudioAt = performance.now() + (start - now) * 1000;
    const played = buffer.duration * 1000;
    this.scheduled.add(source);
    source.onended = () => {
      if (!this.scheduled.delete(source)) return;
      stats.audioPlayedMs += played;
      if (turn) turn.audioPlayedMs += played;
    };
  }

  stopPlayback() {
    for (const source of this.scheduled) {
      try {
        source.stop();
      } catch {
        // never started: nothing to stop
      }
    }
    this.scheduled.clear();
    this.nextStart = 0;
    if (this.decoder && this.decoder.state !== "closed") this.decoder.close();
    this.decoder = null;
  }

  setVolume(volume, fromDevice) {
    this.volume = volume;
    stats.volume = volume;
    if (this.player) this.player.gain.gain.value = volume / 100;
    this.volumeInput.value = String(volume);
    if (fromDevice) announce(T.volumeSet(volume));
  }

  // ---- messages from the bridge ----

  onMessage(event) {
    if (typeof event.data !== "string") {
      this.onAudio(event.data);
      return;
    }
    const message = parse(event.data);
    if (!message) return;
    switch (message.type) {
      case "mcp":
        this.answerMcp(message.payload);
        break;
      case "stt":
        this.onTranscript(String(message.text || ""));
        break;
      case "llm":
        this.onEmotion(message);
        break;
      case "tts":
        this.onTts(message);
        break;
      case "alert":
        this.line("alert", `${message.status || T.alert}: ${message.message || ""}`);
        if (message.status === VOICE_UNAVAILABLE) this.voiceUnavailable(message.message);
        break;
      case "tool_call":
        this.onToolCall(message);
        break;
      default:
        break; // "system", "goodbye" and future messages: nothing to show
    }
  }

  onTranscript(text) {
    stats.transcripts.push(text);
    if (!this.turn) this.turn = newTurn(false); // a turn the page did not start (an apology)
    this.turn.transcript = text;
    this.toolAnchor = this.line("user", text || T.nothingRecognized);
    this.assistantLine = null;
    if (this.state === "listening" || this.state === "idle") this.setState("thinking");
  }

  // One finished tool call of this device's turn, under the turn's words (before its answer,
  // even when the answer's first sentence arrived first).
  onToolCall(message) {
    const call = {
      tool: String(message.tool || ""),
      server: typeof message.server === "string" ? message.server : null,
      arguments: message.arguments === undefined ? null : message.arguments,
      outcome: String(message.outcome || ""),
      durationMs: typeof message.duration_ms === "number" ? message.duration_ms : null,
      error: message.error ? String(message.error) : null,
    };
    stats.toolCalls.push(call);
    if (this.turn) this.turn.toolCalls.push(call);
    const name = call.server ? `${call.server}: ${call.tool}` : call.tool;
    const [mark, label, kind] = outcomeOf(call);
    const entry = el(
      "li",
      { class: `talk-tool ${kind}` },
      el("span", { class: "talk-who", "aria-hidden": "true", text: "🔧 " }),
      el("span", { class: "visually-hidden", text: T.toolCall }),
      el("code", { class: "talk-tool-name", text: name }),
      " ",
      el("code", { class: "talk-tool-arguments", text: formatArguments(call.arguments) }),
      " ",
      el("span", { class: "talk-tool-outcome" }, el("span", { "aria-hidden": "true", text: mark }), el("span", { class: "visually-hidden", text: label })),
      call.durationMs === null ? null : el("span", { class: "talk-tool-duration", text: ` ${formatMs(call.durationMs)}` }),
      call.error && kind !== "ok" ? el("span", { class: "talk-tool-error", text: ` (${errorText(call.error)})` }) : null,
    );
    const anchor = this.toolAnchor;
    if (anchor && anchor.isConnected) {
      anchor.after(entry);
      this.trim(entry);
    } else {
      this.append(entry);
    }
    this.toolAnchor = entry;
  }

  onEmotion(message) {
    const line = this.assistantEntry();
    if (message.emotion) line.dataset.emotion = String(message.emotion);
    line.querySelector(".talk-emotion").textContent = message.text ? `${message.text} ` : "";
  }

  onTts(message) {
    if (message.state === "start") {
      this.stopPlayback();
      this.resetDecoder();
      this.setState("speaking");
    } else if (message.state === "sentence_start") {
      const text = String(message.text || "");
      stats.sentences.push(text);
      const line = this.assistantEntry();
      const words = line.querySelector(".talk-words");
      words.textContent = words.textContent ? `${words.textContent} ${text}` : text;
    } else if (message.state === "stop") {
      // A typed question's turn starts with its `stt`: a stop before it ended the answer it
      // replaced.
      if (this.turn && this.turn.typed && this.turn.transcript === null) return;
      this.finishTurn();
    }
  }

  finishTurn() {
    if (this.turn) {
      this.turn.stoppedAt = performance.now();
      const turn = this.turn;
      stats.turns.push(turn);
      this.turn = null;
      // The last frames are still playing: the turn's played time grows until they end.
    }
    this.assistantLine = null;
    if (this.handsFree) this.startListening("auto");
    else this.setState("idle");
  }

  line(kind, text) {
    const who = { user: T.you, assistant: T.assistant, alert: T.bridge }[kind];
    const entry = el("li", { class: `talk-${kind}` }, el("span", { class: "talk-who", text: `${who}: ` }), el("span", { class: "talk-words", text }));
    this.append(entry);
    return entry;
  }

  assistantEntry() {
    if (!this.assistantLine) {
      this.assistantLine = el(
        "li",
        { class: "talk-assistant" },
        el("span", { class: "talk-who", text: `${T.assistant}: ` }),
        el("span", { class: "talk-emotion", "aria-hidden": "true" }),
        el("span", { class: "talk-words" }),
      );
      this.append(this.assistantLine);
    }
    return this.assistantLine;
  }

  append(entry) {
    this.log.append(entry);
    this.trim(entry);
  }

  trim(entry) {
    // A long hands-free session keeps the last MAX_LINES lines, not every one since the load.
    while (this.log.childElementCount > MAX_LINES) this.log.firstElementChild.remove();
    entry.scrollIntoView({ block: "nearest" });
  }

  // ---- the page's MCP server (the device side of MCP, as stock firmware answers it) ----

  answerMcp(request) {
    const reply = this.mcpReply(request);
    if (reply) this.send({ type: "mcp", payload: reply });
  }

  mcpReply(request) {
    if (!request || typeof request !== "object" || request.jsonrpc !== "2.0") return null;
    const { id, method } = request;
    if (typeof method !== "string" || id === undefined || id === null) return null; // a notification
    const params = request.params && typeof request.params === "object" ? request.params : {};
    if (method === "initialize") {
      return result(id, {
        protocolVersion: typeof params.protocolVersion === "string" ? params.protocolVersion : "2024-11-05",
        capabilities: { tools: {} },
        serverInfo: { name: "esp32-mcp-bridge console", version: "1" },
      });
    }
    if (method === "tools/list") return result(id, { tools: TOOLS });
    if (method === "tools/call") return this.callTool(id, params);
    if (method === "ping") return result(id, {});
    return failure(id, -32601, `Method not found: ${method}`);
  }

  callTool(id, params) {
    const args = params.arguments && typeof params.arguments === "object" ? params.arguments : {};
    if (params.name === STATUS_TOOL) {
      const status = {
        audio_speaker: { volume: this.volume },
        microphone: this.hasCapture ? "available" : "none",
        audio_format: this.uplinkFormat,
      };
      return result(id, text(JSON.stringify(status)));
    }
    if (params.name === VOLUME_TOOL) {
      const volume = args.volume;
      if (typeof volume !== "number" || !Number.isFinite(volume)) return failure(id, -32602, "Missing valid argument: volume");
      if (volume < 0 || volume > 100) return failure(id, -32602, "volume must be between 0 and 100");
      this.setVolume(Math.trunc(volume), true);
      return result(id, text("true"));
    }
    return failure(id, -32602, `Unknown tool: ${String(params.name)}`);
  }
}

// ---- helpers -----------------------------------------------------------------------------------

// What the tests and the benchmark read of a turn (spoken, typed, or started by the bridge).
function newTurn(typed) {
  return {
    typed,
    transcript: null,
    speechEndAt: null, // when the last frame louder than VOICE_RMS reached the page (auto)
    firstFrameAt: null, // when the answer's first frame arrived
    firstAudioAt: null, // when it starts playing (scheduled on the audio clock)
    framesReceived: 0,
    audioPlayedMs: 0,
    toolCalls: [],
    stoppedAt: null,
  };
}

// [shown mark, what a screen reader says, class] of a tool call's outcome.
function outcomeOf(call) {
  if (call.outcome === "ok") return ["✓", T.outcomeOk, "ok"];
  if (call.error === "ConfirmationRequired") return ["?", T.outcomeNeedsYes, "warn"];
  if (call.outcome === "tool_error") return ["⚠", T.outcomeToolError, "warn"];
  if (call.outcome === "refused") return ["✗", T.outcomeRefused, "error"];
  return ["✗", T.outcomeFailed, "error"];
}

// The bridge names an error by its class: the one a user acts on is said in words.
function errorText(error) {
  return error === "ConfirmationRequired" ? T.waitsForYes : error;
}

// `{volume: 30}`: keys bare when they are identifiers, values as JSON; long ones cut.
function formatArguments(value) {
  if (value === null || value === undefined) return T.argumentsHidden;
  let text;
  if (typeof value === "object" && !Array.isArray(value)) {
    const parts = Object.entries(value).map(([key, item]) => `${/^[A-Za-z_$][\w$]*$/.test(key) ? key : JSON.stringify(key)}: ${JSON.stringify(item)}`);
    text = `{${parts.join(", ")}}`;
  } else {
    text = JSON.stringify(value);
  }
  return text.length > MAX_ARGUMENTS_CHARS ? `${text.slice(0, MAX_ARGUMENTS_CHARS - 1)}…` : text;
}

async function chooseFormat() {
  // Opus needs both halves of WebCodecs: the encoder for the microphone, the decoder for the
  // answer (the bridge answers in the format the hello asks in).
  if (!("AudioEncoder" in window) || !("AudioDecoder" in window)) return "pcm16";
  try {
    const encoding = await AudioEncoder.isConfigSupported(OPUS_CONFIG);
    const decoding = await AudioDecoder.isConfigSupported({ codec: "opus", sampleRate: 24000, numberOfChannels: 1 });
    return encoding.supported && decoding.supported ? "opus" : "pcm16";
  } catch {
    return "pcm16";
  }
}

function microphoneProblem(error) {
  if (error.name === "NotAllowedError" || error.name === "SecurityError") {
    return T.micRefused;
  }
  if (error.name === "NotFoundError" || error.name === "OverconstrainedError") {
    return T.micMissing;
  }
  return T.cannotListen(error.message);
}

function parse(text) {
  try {
    const value = JSON.parse(text);
    return value && typeof value === "object" ? value : null;
  } catch {
    return null;
  }
}

function rms(samples) {
  let sum = 0;
  for (let i = 0; i < samples.length; i++) sum += samples[i] * samples[i];
  return Math.sqrt(sum / samples.length);
}

function toPcm16(samples) {
  const out = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    const value = Math.max(-1, Math.min(1, samples[i]));
    out[i] = value < 0 ? value * 0x8000 : value * 0x7fff;
  }
  return new Uint8Array(out.buffer); // little-endian on every platform a browser runs on
}

function fromPcm16(bytes) {
  const count = Math.floor(bytes.byteLength / 2);
  const view = new DataView(bytes.buffer, bytes.byteOffset, count * 2);
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) out[i] = view.getInt16(i * 2, true) / 0x8000;
  return out;
}

function result(id, value) {
  return { jsonrpc: "2.0", id, result: value };
}

function failure(id, code, message) {
  return { jsonrpc: "2.0", id, error: { code, message } };
}

function text(value) {
  return { content: [{ type: "text", text: value }], isError: false };
}
