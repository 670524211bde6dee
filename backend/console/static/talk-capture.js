// The talk page's microphone tap (an AudioWorklet): 60 ms frames of 16 kHz mono samples.
// The page asks for a 16 kHz AudioContext, so this normally only cuts frames; a browser that
// runs the context at another rate gets a linear resampler here (speech survives it).

const TARGET_RATE = 16000;

class TalkCapture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.size = options.processorOptions.frameSamples;
    this.frame = new Float32Array(this.size);
    this.fill = 0;
    this.step = sampleRate / TARGET_RATE; // input samples per output sample
    this.position = 0; // where the next output sample falls in the input (-1: `previous`)
    this.previous = 0; // the last input sample of the previous block, for interpolation
  }

  push(value) {
    this.frame[this.fill++] = value;
    if (this.fill === this.size) {
      this.port.postMessage(this.frame, [this.frame.buffer]);
      this.frame = new Float32Array(this.size);
      this.fill = 0;
    }
  }

  process(inputs) {
    const input = inputs[0];
    if (!input || input.length === 0) return true;
    const samples = input[0];
    if (this.step === 1) {
      for (let i = 0; i < samples.length; i++) this.push(samples[i]);
      return true;
    }
    // Linear interpolation. `position` counts from the previous block's last sample (-1).
    while (this.position < samples.length - 1) {
      const index = Math.floor(this.position);
      const fraction = this.position - index;
      const before = index < 0 ? this.previous : samples[index];
      const after = samples[index + 1];
      this.push(before + (after - before) * fraction);
      this.position += this.step;
    }
    this.position -= samples.length;
    this.previous = samples[samples.length - 1];
    return true;
  }
}

registerProcessor("talk-capture", TalkCapture);
